"""Typed schemas of a run's configuration, checked before any model loads.

Hydra composes configs/config.yaml (+ model/, task/, probe/ or experiment/) over the dataclasses
below, registered in Hydra's ConfigStore: a misspelt key or a wrong type fails at composition,
and `validate` then builds the dataclasses, whose `__post_init__` checks values (a model name
that is not registered lists the valid ones). Each registered probe or experiment gets a schema
node schema/<kind>/<name> (its own config class plus a fixed `name`); a yaml in configs/<kind>/ is
optional and, when present, lists `/schema/<kind>/<name>@_here_` first in `defaults`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from kvnotes.errors import ConfigError
from kvnotes.measure import margins
from kvnotes.models import FAMILIES, UnknownModelError, budget, get_spec
from runner import jobs
from runner.bounds import number_problem
from runner.task_config import SCHEMAS, kind_of, schema_for

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KINDS: tuple[jobs.Kind, ...] = ("probe", "experiment")


def _check_dtype(dtype: str, where: str) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"{where}={dtype!r} is not a dtype; valid: {', '.join(DTYPES)}")


@dataclass
class ModelConfig:
    """Which registered model to load (configs/model/<name>.yaml, one per registered name)."""

    name: str = MISSING
    dtype: str = "auto"  # auto: the registry's default dtype for this model
    # minimum |score_new - score_old| for an item to count as usable; None: the model's own
    # (kvnotes.measure.margins.margin_of, the one source), filled in here so that every path,
    # the saved config and the run's hash carry the number the run judges by
    margin: float | None = None
    chat: bool = True  # apply the chat template when the tokenizer has one
    tiny_family: str | None = None  # tests: a tiny random model of this family, no weights

    def __post_init__(self) -> None:
        if self.name == MISSING:  # the bare schema, before a model yaml fills it in
            return
        if self.tiny_family is not None:
            if self.tiny_family not in FAMILIES:
                raise ConfigError(
                    f"model.tiny_family={self.tiny_family!r}; valid families: {', '.join(FAMILIES)}"
                )
            if self.name != f"tiny-{self.tiny_family}":
                raise ConfigError(f"a tiny model is named tiny-{self.tiny_family}, not {self.name!r}")
        else:
            try:
                get_spec(self.name)
            except UnknownModelError as e:
                raise ConfigError(f"model.name: {e}") from None
        _check_dtype(self.dtype, "model.dtype")
        if self.margin is None:
            self.margin = margins.margin_of(self.name)
        if not self.margin >= 0:
            raise ConfigError(f"model.margin must be >= 0, got {self.margin}")


@dataclass
class RunConfig:
    """The top level: what to run (probe or experiment), on which model, where results go."""

    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0
    device: str = "auto"  # auto: CUDA when available, else CPU
    dtype: str = "auto"  # auto: model.dtype
    results_dir: str = "results/runs"  # relative to the working directory
    resume: bool = True  # continue the newest unfinished run with the same config hash
    cache_dir: str | None = None  # None: ~/.cache/kvnotes
    progress: bool = True  # tqdm bars over units
    threads: int | None = None  # torch CPU threads; None: OMP_NUM_THREADS, else this process's cores split among parallel jobs
    # What a load checks of a packaged model's weights: `header` (sizes and safetensors headers,
    # milliseconds; a byte changed inside a tensor passes, and meta.json says its weights_sha256
    # is the conversion's record) or `full` (every byte re-hashed: 0.36 s for llama's 517 MB on a
    # 2-core AMD EPYC, against 0.004 s; `python -m kvnotes.models verify llama`, which also
    # re-hashes the GGUF, takes 2-3 s there). configs/config.yaml reads $KVNOTES_VERIFY_WEIGHTS,
    # which scripts/reference_queue.sh sets to `full` for the reference runs.
    verify_weights: str = "header"
    task: Any = None  # task suite (configs/task/): a TaskConfig of runner.task_config once validated
    probe: Any = None  # +probe=<name>: configs/probe/<name>.yaml
    experiment: Any = None  # +experiment=<name>: configs/experiment/<name>.yaml

    def __post_init__(self) -> None:
        if not DEVICE.match(self.device):
            raise ConfigError(f"device={self.device!r}; valid: auto, cpu, cuda, cuda:<n>")
        _check_dtype(self.dtype, "dtype")
        if not self.results_dir:
            raise ConfigError("results_dir must not be empty")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or null, got {self.threads}")
        if self.verify_weights not in ("header", "full"):
            raise ConfigError(f"verify_weights={self.verify_weights!r}; valid: header, full")


@dataclass(frozen=True)
class Job:
    """A validated run: the typed top level, what to run and that job's own typed config."""

    cfg: RunConfig
    kind: jobs.Kind
    name: str
    params: Any  # instance of the entry's config class (a DictConfig when it has none)
    entry: jobs.Entry


def schema_node(name: str, config_cls: type | None) -> DictConfig:
    """The ConfigStore node of a probe/experiment: its typed config plus a fixed `name`."""
    node = OmegaConf.structured(config_cls) if config_cls is not None else OmegaConf.create({})
    with open_dict(node):
        node.name = name
    return node


def register_schemas(config_dir: Path = CONFIG_DIR) -> None:
    """Store RunConfig, ModelConfig and every registered entry's schema in Hydra's ConfigStore.

    A registered job without configs/<kind>/<name>.yaml gets its schema stored as the option
    <kind>/<name> itself, so `+probe=<name>` works with the dataclass defaults; a yaml, when
    present, lists the schema first and overrides what it needs.
    """
    # deferred: hydra is heavy and only this path needs it
    from hydra.core.config_store import ConfigStore


    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="schema", name="model", node=ModelConfig)
    for kind, cls in SCHEMAS.items():
        cs.store(group="schema/task", name=kind, node=cls)
    OmegaConf.register_new_resolver("kvnotes_groups", lambda: help_groups(config_dir), replace=True)
    for kind in KINDS:
        for name in jobs.names(kind):
            node = schema_node(name, jobs.get(kind, name).config_cls)
            cs.store(group=f"schema/{kind}", name=name, node=node)
            if not (config_dir / kind / f"{name}.yaml").exists():
                cs.store(group=kind, name=name, node=node)


def help_groups(config_dir: Path = CONFIG_DIR) -> str:
    """The groups `--help` lists: configs/<group>/*.yaml plus jobs with no yaml (not schema/)."""
    lines = []
    for group in sorted(p.name for p in config_dir.iterdir() if p.is_dir() and p.name != "hydra"):
        options = {p.stem for p in (config_dir / group).glob("*.yaml")}
        if group in KINDS:
            options |= set(jobs.names(group))
        lines.append(f"{group}: {', '.join(sorted(options))}")
    return "\n".join(lines)


def valid_jobs() -> str:
    return "; ".join(
        f"valid {kind}s: {', '.join(jobs.names(kind)) or '(none)'} (+{kind}=<name>)"
        for kind in KINDS
    )


def _job_name(kind: str, node: Any) -> str:
    if isinstance(node, str):  # +probe=<name> with no configs/probe/ group: a plain value
        raise ConfigError(f"configs/{kind}/{node}.yaml does not exist; {valid_jobs()}")
    name = node.get("name") if isinstance(node, DictConfig | dict) else None
    if not name:
        raise ConfigError(
            f"the {kind} config has no name: configs/{kind}/<name>.yaml must list "
            f"`defaults: [/schema/{kind}/<name>@_here_, _self_]`"
        )
    return str(name)


def one_line(e: BaseException, prefix: str = "") -> str:
    """An OmegaConf/Hydra error as one line: `<full key>: <first line of the message>`."""
    if isinstance(e, ConfigError):
        return str(e)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), "")
    head = lines[0] if lines else type(e).__name__
    return f"{prefix}{key}: {head}" if key else f"{prefix.rstrip('.')}{': ' if prefix else ''}{head}"


def _typed(cls: type, node: Any, where: str) -> Any:
    """Instance of `cls` from `node` (type checks by OmegaConf, value checks by __post_init__).

    `where` prefixes the key in messages ("task.", "experiment."), so a message names the
    override to fix.
    """
    try:  # a plain copy: merging a typed node would let keys added with `+` through
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), plain))
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, ConfigError) else e
        raise ConfigError(one_line(cause, where)) from None
    problem = number_problem(obj, where)  # finite floats, seeds numpy takes, counts >= 0
    if problem:
        raise ConfigError(problem)
    return obj


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (not POSIX): say "no permission"
        return False


def results_problem(results_dir: str) -> str | None:
    """Why runs cannot be written under `results_dir` (a file in the way, a read-only file
    system, no permission), or None."""
    path = Path(results_dir).absolute()
    probe = path
    while not probe.exists():  # the nearest existing ancestor must be a writable directory
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == path else f"lies under {probe}, which is a file"
        return f"results_dir={results_dir!r} {where}, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        if _read_only(probe):
            return f"results_dir={results_dir!r}: {probe} is on a read-only file system"
        return f"results_dir={results_dir!r}: no permission to write in {probe}"
    return None


def typed_task(node: Any, run_cfg: RunConfig) -> Any:
    """The task group as its kind's dataclass, its length bounded by the model and memory."""

    task = _typed(schema_for(kind_of(node)), node, "task.")
    shape = budget.model_shape(run_cfg.model.name, run_cfg.model.tiny_family, run_cfg.cache_dir)
    dtype = run_cfg.dtype if run_cfg.dtype != "auto" else run_cfg.model.dtype
    problem = (budget.position_problem(task.length, run_cfg.model.name, shape) if shape else None) or \
        budget.memory_problem(task.n_items, task.length, shape,
                              budget.DTYPE_BYTES.get(dtype, 4), run_cfg.device)
    if problem:
        raise ConfigError(problem)
    return task


def prompt_problem(params: Any, kind: str, run_cfg: RunConfig) -> str | None:
    """A job whose config sets its own prompt length (`longest_prompt()` -> (setting, tokens,
    tokens around them)) checked against the model's positions, before any weights load."""
    longest = getattr(params, "longest_prompt", None)
    if not callable(longest):
        return None

    shape = budget.model_shape(run_cfg.model.name, run_cfg.model.tiny_family, run_cfg.cache_dir)
    found = longest()
    if shape is None or found is None:
        return None
    setting, tokens, overhead = found
    return budget.position_problem(tokens, run_cfg.model.name, shape, f"{kind}.{setting}", overhead)


def validate(cfg: DictConfig, check_inputs: bool = True) -> Job:
    """Typed, checked view of a composed config; raises ConfigError naming what is valid.

    A job config with `check_run(run_cfg)` has it called here, before any weights load: it
    raises ConfigError when what the config reads outside itself (another run's records) does not
    fit this run (its model). `check_inputs=False` skips that: summarising a finished run again
    reads its own records, not its inputs (which may since have moved)."""
    run_cfg: RunConfig = _typed(RunConfig, cfg, "")
    problem = results_problem(run_cfg.results_dir)
    if problem:
        raise ConfigError(problem)
    chosen = [k for k in KINDS if cfg.get(k) is not None]
    if len(chosen) != 1:
        what = "both +probe and +experiment" if chosen else "no +probe or +experiment"
        raise ConfigError(f"{what} given; {valid_jobs()}")
    kind = chosen[0]
    node = cfg[kind]
    name = _job_name(kind, node)
    try:
        entry = jobs.get(kind, name)
    except KeyError as e:
        raise ConfigError(f"{e.args[0]}; {valid_jobs()}") from None
    body = OmegaConf.masked_copy(node, [k for k in node if k != "name"])
    params = body if entry.config_cls is None else _typed(entry.config_cls, body, f"{kind}.")
    problem = prompt_problem(params, kind, run_cfg)
    if problem:
        raise ConfigError(problem)
    check_run = getattr(params, "check_run", None)
    if check_inputs and callable(check_run):  # what a job's config reads outside itself, checked against the run
        check_run(run_cfg)
    if cfg.get("task") is not None:
        run_cfg = replace(run_cfg, task=typed_task(cfg.task, run_cfg))
    return Job(run_cfg, kind, name, params, entry)
