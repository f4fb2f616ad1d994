"""Hydra entry point: `python -m experiments.run +probe=<name> | +experiment=<name> model=<name>`.

`main` is a thin `@hydra.main`; everything testable is `run(cfg) -> run_dir`: validate the
composed config (before any model loads), open or resume the run directory, load the model,
then drive the registered probe or experiment unit by unit, and write records and summary.
A probe is called once per unit of `unit_size` task items (0: all items in one unit), so an
interrupted run resumes at the first unit not on disk; an experiment gets a `Context` and
writes its own units through `ctx.pending` / `ctx.write` (records it returns form one more unit).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import pkgutil
import random
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from experiments.config import ConfigError, Job, RunConfig, register_schemas, validate
from experiments.output import RecordWriter, RunDir, config_hash, now_iso, read_json, summary_table
from kvnotes import provenance

log = logging.getLogger(__name__)
INFRA = frozenset({"run", "config", "output", "registry", "summarize"})  # experiments/ modules that register nothing
RETURNED = "returned"  # unit key of the records an experiment returns


def discover() -> list[str]:
    """Import every module of probes/ and experiments/ so their @register decorators run."""
    imported = []
    for package in ("probes", "experiments"):
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_") or (package == "experiments" and info.name in INFRA):
                continue
            imported.append(importlib.import_module(f"{package}.{info.name}").__name__)
    return imported


def prepare() -> None:
    """Registry filled and schemas stored: call before Hydra composes a config."""
    discover()
    register_schemas()


@dataclasses.dataclass
class Context:
    """What an experiment's `run(ctx)` receives: the job, the model and the unit writer."""

    job: Job
    model: Any  # kvnotes.models.LoadedModel
    writer: RecordWriter
    run_dir: Path

    @property
    def cfg(self) -> RunConfig:
        return self.job.cfg

    @property
    def params(self) -> Any:
        return self.job.params

    @property
    def chat(self) -> bool:
        """Render prompts with the chat template: the config asks for it and the tokenizer has one."""
        return use_chat(self.cfg, self.model)

    def pending(self, keys: Sequence[Any], desc: str = "units") -> Iterator[Any]:
        """The keys whose unit is not on disk yet, with a progress bar over all of them."""
        from tqdm.auto import tqdm

        done = [k for k in keys if self.writer.done(k)]
        if done:
            log.info("resuming: %d of %d %s already done", len(done), len(keys), desc)
        bar = tqdm(total=len(keys), initial=len(done), desc=desc, disable=not self.cfg.progress)
        with bar:
            for key in keys:
                if self.writer.done(key):
                    continue
                yield key
                bar.update(1)

    def write(self, key: Any, records: Iterable[Mapping[str, Any]]) -> None:
        self.writer.write(key, records)


def _seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load(cfg: RunConfig) -> Any:
    """The configured model on the configured device and dtype (`auto` dtype: model.dtype)."""
    from kvnotes.models import load_model, resolve_device, resolve_dtype

    dtype = cfg.dtype if cfg.dtype != "auto" else cfg.model.dtype
    if cfg.model.tiny_family is None:
        model = load_model(cfg.model.name, device=cfg.device, dtype=dtype, cache=cfg.cache_dir)
        spec = dataclasses.replace(model.spec, margin=cfg.model.margin)  # probes read spec.margin
        return dataclasses.replace(model, spec=spec)
    from kvnotes.models.tiny import tiny_model

    model = tiny_model(cfg.model.tiny_family, seed=cfg.seed, dtype=resolve_dtype(dtype))
    model.hf.to(resolve_device(cfg.device))
    return model


def use_chat(cfg: RunConfig, model: Any) -> bool:
    return bool(cfg.model.chat and model.chat)


def load_items(model: Any, cfg: RunConfig) -> list[Any]:
    """Task items for a probe from kvnotes.tasks, built for this model's tokenizer."""
    if importlib.util.find_spec("kvnotes.tasks") is None:
        raise ConfigError("probes need task items from kvnotes.tasks, which is not installed yet")
    if cfg.task is None:
        raise ConfigError("a probe needs a task suite: add task=<suite> (configs/task/)")
    from kvnotes import tasks

    spec = dict(cfg.task)
    name = spec.pop("name", None)
    chat = use_chat(cfg, model)
    if spec.get("seed") is None:  # the run's seed draws the suite unless the task pins one
        spec["seed"] = cfg.seed
    return list(tasks.build_suite(name, tokenizer=model.tokenizer, chat=chat, **spec))


def item_key(item: Any, index: int) -> str:
    """A unit key for an item: its `item_id` (or `id`) when it has one, else its index."""
    ident = getattr(item, "item_id", None) or getattr(item, "id", None)
    if ident is None and isinstance(item, Mapping):
        ident = item.get("item_id", item.get("id"))
    return f"item-{index:05d}" if ident is None else f"item-{ident}"


def run_probe(ctx: Context) -> None:
    """Call the probe once per unit of items; each unit's records go to disk before the next."""
    items = load_items(ctx.model, ctx.cfg)
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


def run(cfg: DictConfig) -> Path:
    """Validate, open/resume the run directory, run the job, write records + summary."""
    discover()  # a launcher's worker process (joblib, submitit) starts with an empty registry
    job = validate(cfg)
    from kvnotes.models import resolve_device

    device = str(resolve_device(job.cfg.device))
    chash = config_hash(cfg, device)
    meta = {
        "kind": job.kind,
        "name": job.name,
        "model_name": job.cfg.model.name,
        "seed": job.cfg.seed,
        "device": device,
        **provenance.collect(),
    }
    rd = RunDir.open(Path(job.cfg.results_dir), job.name, job.cfg.model.name, cfg, chash,
                     job.cfg.resume, meta)
    log.info("%s run dir: %s", "resuming" if rd.resumed else "new", rd.path)
    try:
        _seed(job.cfg.seed)
        model = load(job.cfg)
        rd.update(model=model.provenance(), dtype=str(model.dtype).removeprefix("torch."))
        ctx = Context(job, model, RecordWriter(rd.path), rd.path)
        (run_probe if job.kind == "probe" else run_experiment)(ctx)
        records = ctx.writer.finalize()
        rd.write_summary(build_summary(job, records) | {"finished": now_iso()})
    except KeyboardInterrupt:
        rd.set_status("interrupted")
        raise
    except BaseException as e:
        rd.set_status("failed", error=f"{type(e).__name__}: {e}")
        raise
    rd.set_status("completed")
    ctx.writer.cleanup()
    return rd.path


@hydra.main(config_path="../configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from kvnotes.models import WeightsError

    try:
        path = run(cfg)
    except (ConfigError, WeightsError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        print("interrupted: finished units are on disk; rerun the same command to resume",
              file=sys.stderr)
        sys.exit(130)
    print(summary_table(read_json(path / "summary.json")))
    print(f"run dir: {path}")


if __name__ == "__main__":
    prepare()
    main()
