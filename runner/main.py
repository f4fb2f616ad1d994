"""The runner: `python -m experiments.run +probe=<name> | +experiment=<name> model=<name>`.

`main` is a thin `@hydra.main`; everything testable is `run(cfg) -> run_dir`: validate the
composed config (before any model loads), open or resume the run directory, load the model,
then drive the job (runner/jobs.py finds it) unit by unit, and write records and summary.
A probe is called once per unit of `unit_size` task items (0: all items in one unit), so an
interrupted run resumes at the first unit not on disk; an experiment gets a Context
(runner/context.py) and writes its own units through `ctx.pending` / `ctx.write` (records it
returns form one more unit).
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from kvnotes.errors import ConfigError
from kvnotes.measure import provenance, runfiles
from kvnotes.measure.timing import MemoryBudgetError, check_fits, torch_threads
from kvnotes.models import LoadedModel, WeightsError, resolve_device
from runner import harness
from runner.config import CONFIG_DIR, Job, RunConfig, one_line, register_schemas, validate
from runner.context import Context, check_lengths, item_key, load
from runner.endings import (
    disk_failure,
    interrupted_line,
    reading_tip,
    record_end,
    sigterm_interrupts,
)
from runner.files import NoFollowFileHandler, append_text, atomic_write, now_iso, read_json
from runner.jobs import discover
from runner.records import RecordWriter
from runner.rundir import RunDir, RunDirError, config_hash
from runner.table import summary_table

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
RETURNED = "returned"  # unit key of the records an experiment returns


def prepare() -> None:
    """Registry filled and schemas stored: call before Hydra composes a config."""
    discover()
    register_schemas()


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_probe(ctx: Context) -> None:
    """Call the probe once per unit of items; each unit's records go to disk before the next."""
    items = ctx.items()
    size = int(getattr(ctx.params, "unit_size", 1) or 0) or len(items) or 1
    units = {item_key(items[i], i): items[i : i + size] for i in range(0, len(items), size)}
    if len(units) != -(-len(items) // size):
        raise ValueError("task items have duplicate ids; unit keys must be unique")
    for key in ctx.pending(list(units), desc=f"{ctx.job.name} items"):
        ctx.write(key, ctx.job.entry.run(ctx.model, units[key], ctx.params))


def run_experiment(ctx: Context) -> None:
    returned = ctx.job.entry.run(ctx)
    if returned is not None and not ctx.writer.done(RETURNED):
        ctx.write(RETURNED, returned)


def build_summary(job: Job, records: Any) -> dict[str, Any]:
    """summary.json's content from a run's records (a DataFrame): counts, then the job's own."""
    summary: dict[str, Any] = {"kind": job.kind, "name": job.name, "model": job.cfg.model.name,
                               "n_records": len(records)}
    if job.entry.summarize is not None:
        summary |= job.entry.summarize(records.to_dict("records"), job.params)
    return summary


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as a user would type it again (`python -m experiments.run ...`)."""
    argv = list(sys.argv if argv is None else argv) or [""]
    if argv[0].endswith(("experiments/run.py", "runner/__main__.py")):
        head = ["python", "-m", "experiments.run"]
    else:  # `kvnotes run` (kvnotes.cli) sets argv[0] to its two words
        head = argv[0].split() if argv[0].startswith("kvnotes ") else argv[:1]
    return shlex.join([*head, *argv[1:]])


def hydra_overrides() -> list[str] | None:
    """This job's overrides as Hydra parsed them (per job in a multirun), None outside Hydra."""

    if not HydraConfig.initialized():
        return None
    return list(HydraConfig.get().overrides.task)


def record_invocation(path: Path, attempt: int) -> None:
    """command.txt (one line per attempt) and overrides.yaml (this attempt's): how to rerun it."""

    append_text(path / runfiles.COMMAND, f"# attempt {attempt}, {now_iso()}, cwd {Path.cwd()}\n{command_line()}\n")
    overrides = hydra_overrides()
    atomic_write(path / runfiles.OVERRIDES, yaml.safe_dump(overrides if overrides is not None else [],
                                                         default_flow_style=False).encode())


class RunLog:
    """Everything logged while the run dir is open also goes to <run dir>/run.log (appended,
    never through a link)."""

    def __init__(self, path: Path) -> None:
        self.handler = NoFollowFileHandler(path / runfiles.LOG, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self.root = logging.getLogger()
        self.level = self.root.level

    def __enter__(self) -> RunLog:
        self.root.addHandler(self.handler)
        if self.level > logging.INFO:  # the run's INFO lines belong in run.log
            self.root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self.root.removeHandler(self.handler)
        self.root.setLevel(self.level)
        self.handler.close()


def check_loaded_positions(cfg: RunConfig, model: LoadedModel) -> None:
    """The position bound, when validation could not read the model's config (fetched just now)."""
    limit = getattr(model.hf.config, "max_position_embeddings", None)
    if cfg.task is None or cfg.model.tiny_family is not None or not isinstance(limit, int):
        return
    if cfg.task.length > limit:
        raise ConfigError(f"task.length={cfg.task.length} exceeds the {limit} positions of model "
                          f"{cfg.model.name}; use task.length <= {limit}")


def run(cfg: DictConfig) -> Path:
    """Validate, open/resume the run directory, run the job, write records + summary."""
    discover()  # a launcher's worker process (joblib, submitit) starts with an empty registry
    job = validate(cfg)  # nothing is written before the config is valid

    device = str(resolve_device(job.cfg.device))
    threads, why = threads_for(job.cfg)  # a bad OMP_NUM_THREADS is refused before the run dir
    check_lengths(job)  # a task.length below its suite's prompts too, with the tokenizer alone
    with open_dict(cfg):  # the margin the run judges by, resolved (kvnotes.measure.margins), is saved
        cfg.model.margin = job.cfg.model.margin
    chash = config_hash(cfg, device)
    meta = {
        "kind": job.kind,
        "name": job.name,
        "model_name": job.cfg.model.name,
        "seed": job.cfg.seed,
        "device": device,
        **provenance.collect(),
    }
    # the threads the job runs with, not the ones this process had before the runner set them
    meta["machine"] = {**meta["machine"], **ran_with(job, threads, why)}
    attempt = {"command": command_line(), "overrides": hydra_overrides(), "pid": os.getpid(),
               "host": socket.gethostname()}
    rd = RunDir.open(Path(job.cfg.results_dir), job.name, job.cfg.model.name, cfg, chash,
                     job.cfg.resume, meta, attempt)
    try:
        with sigterm_interrupts():  # a scheduler's SIGTERM ends the run as Ctrl-C does
            _run_in(rd, job, threads, why)
    finally:
        rd.close()
    return rd.path


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parallel_jobs() -> int:
    """How many jobs run at once beside this one: a joblib multirun's n_jobs, else 1."""

    if not HydraConfig.initialized():
        return 1
    launcher = HydraConfig.get().launcher
    n = launcher.get("n_jobs") if launcher is not None and "joblib" in str(launcher.get("_target_", "")) else None
    cores = _cores()
    return 1 if not n else (cores if int(n) < 0 else min(int(n), cores))


def env_threads(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS as a thread count (the first of a nested list "4,2", as OpenMP reads it),
    None when unset or empty; ConfigError in one line when it is not a count >= 1."""
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(f"OMP_NUM_THREADS={raw!r} is not a thread count >= 1: set it to one "
                          f"(e.g. OMP_NUM_THREADS=1) or unset it")
    return int(first)


def threads_for(cfg: RunConfig, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """torch's CPU threads for a job, and why: the config's `threads`, else OMP_NUM_THREADS when
    set, else this process's cores split among the jobs a parallel multirun runs at once (N jobs on
    C cores never run N x C). In a joblib multirun OMP_NUM_THREADS caps each job's share: joblib
    sets it in its workers (to the user's value, or to its own split)."""
    if cfg.threads is not None:
        return cfg.threads, "threads= in the config"
    omp = env_threads(os.environ if env is None else env)
    cores, jobs = _cores(), parallel_jobs()
    split = max(1, cores // jobs)
    if omp is not None and (jobs == 1 or omp < split):
        return omp, f"OMP_NUM_THREADS={omp}"
    return split, f"{cores} cores / {jobs} parallel job{'s' if jobs > 1 else ''}"


def ran_with(job: Job, threads: int, why: str) -> dict[str, Any]:
    """meta.json's record of the job's torch threads: the runner's, or the job's own `threads`
    setting, which the job applies around its work (the composition experiments' timing)."""
    own = getattr(job.params, "threads", None)
    if isinstance(own, int) and not isinstance(own, bool) and own >= 1:
        threads, why = own, f"{job.kind}.threads={own}"
    return {"torch_threads": threads, "torch_threads_from": why}


def _run_in(rd: RunDir, job: Job, threads: int, why: str) -> None:
    """Run the job inside an open (locked) run directory; its status says how it ended."""
    try:
        record_invocation(rd.path, len(rd.meta["attempts"]))
        with RunLog(rd.path):
            writer = _run_job(rd, job, threads, why)
    except KeyboardInterrupt:
        record_end(rd, "interrupted")
        raise
    except BaseException as e:
        disk = disk_failure(rd, e)
        if disk is not None:
            raise disk from None
        record_end(rd, "failed", error=f"{type(e).__name__}: {e}")
        raise
    writer.cleanup()  # never raises: a completed run stays completed


def _run_job(rd: RunDir, job: Job, threads: int, why: str) -> RecordWriter:
    """Load, run and summarise with `threads` torch threads; the run is marked completed here
    (logged in run.log)."""
    log.info("%s run dir: %s", "resuming" if rd.resumed else "new", rd.path)
    log.info("command: %s", command_line())
    try:
        _seed(job.cfg.seed)
        log.info("torch threads: %d (%s)", threads, why)
        with torch_threads(threads):  # restored after the job
            model = load(job.cfg)
            check_loaded_positions(job.cfg, model)
            if job.cfg.task is not None:  # before the job: its estimated peak, or a refusal
                log.info(check_fits(model, job.cfg.task.length))
            rd.update(model=model.provenance(), dtype=str(model.dtype).removeprefix("torch."))
            ctx = Context(job, model, RecordWriter(rd.path), rd.path)
            (run_probe if job.kind == "probe" else run_experiment)(ctx)
        records = ctx.writer.finalize()
        rd.write_summary(build_summary(job, records) | {"finished": now_iso()})
        rd.set_status("completed")
    except KeyboardInterrupt:
        log.info("interrupted: %s", rd.path)
        raise
    except BaseException as e:
        log.error("failed: %s: %s", type(e).__name__, e)
        raise
    log.info("completed: %s", rd.path)
    return ctx.writer


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        path = run(cfg)
    except (ConfigError, WeightsError, RunDirError, MemoryBudgetError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:
        line, code = interrupted_line(e)
        print(line, file=sys.stderr)
        sys.exit(code)
    print(summary_table(read_json(path / runfiles.SUMMARY)))
    print(f"run dir: {path}")
    print(reading_tip(path))


def cli() -> None:
    """`python -m experiments.run`: Hydra's main, with a config that does not compose (a
    misspelt key, a wrong type) reported as one `error:` line instead of Hydra's report.

    Hydra re-raises instead of reporting when HYDRA_FULL_ERROR is set; unless the user set it
    (then they want the full trace), we set it, catch composition errors and print one line.
    """

    harness.check()  # a package a job imports after the model loads (scikit-learn), one line now
    prepare()
    if os.environ.get("HYDRA_FULL_ERROR"):
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        sys.exit(f"error: {compose_message(e)}")
    except yaml.YAMLError as e:  # a config file Hydra's loader cannot read safely (a !!python tag)
        sys.exit(f"error: {' '.join(str(e).split())}; a config file holds plain YAML (no tags)")
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)


def compose_message(e: BaseException) -> str:
    """One line from a Hydra composition error and the OmegaConf error that caused it."""
    if isinstance(e, OmegaConfBaseException):
        return one_line(e)
    lines = [" ".join(line.split()) for line in str(e).splitlines() if line.strip()]
    head = lines[0].rstrip(".") if lines else type(e).__name__
    if isinstance(e.__cause__, OmegaConfBaseException):
        return f"{head}: {one_line(e.__cause__)}"
    if len(lines) > 1:  # "Available options in 'task':", one option per line, the search path
        options = lines[2:lines.index("Config search path:")] if "Config search path:" in lines else lines[2:]
        return f"{head}; {lines[1]} {', '.join(options)}".rstrip()
    return head


if __name__ == "__main__":
    cli()
