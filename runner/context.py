"""The runner's side of a job: the model it loads, the task items it builds, the Context an
experiment receives (the shape of experiments.shared.context.Context)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
from tqdm.auto import tqdm

from kvnotes import tasks
from kvnotes.errors import ConfigError
from kvnotes.models import LoadedModel, load_model, resolve_device, resolve_dtype
from kvnotes.models.tiny import tiny_model
from kvnotes.pairs.file import load_pairs
from kvnotes.tasks.item import TaskItem
from runner.config import Job, RunConfig
from runner.rundir import RecordWriter, write_json

log = logging.getLogger(__name__)
K = TypeVar("K")


def load(cfg: RunConfig) -> LoadedModel:
    """The configured model on the configured device and dtype (`auto` dtype: model.dtype)."""

    dtype = cfg.dtype if cfg.dtype != "auto" else cfg.model.dtype
    if cfg.model.tiny_family is None:
        model = load_model(cfg.model.name, device=cfg.device, dtype=dtype, cache=cfg.cache_dir,
                           verify_weights=cfg.verify_weights)
        return model.with_margin(cfg.model.margin)  # probes and experiments read model.margin

    device = resolve_device(cfg.device)
    model = tiny_model(cfg.model.tiny_family, seed=cfg.seed, dtype=resolve_dtype(dtype, device=device))
    model.hf.to(device)
    return model.with_margin(cfg.model.margin)


def use_chat(cfg: RunConfig, model: LoadedModel) -> bool:
    return bool(cfg.model.chat and model.chat)


def load_items(model: LoadedModel, cfg: RunConfig) -> list[TaskItem]:
    """Task items from kvnotes.tasks, built for this model's tokenizer."""
    if importlib.util.find_spec("kvnotes.tasks") is None:
        raise ConfigError("probes need task items from kvnotes.tasks, which is not installed yet")
    if cfg.task is None:
        raise ConfigError("a probe needs a task suite: add task=<suite> (configs/task/)")

    kwargs = cfg.task.build_kwargs()  # a TaskConfig (runner.task_config), validated
    if cfg.task.KIND == "pairs":  # the user's prompts, verbatim
        try:
            return load_pairs(kwargs["path"], model.tokenizer, kwargs["n_items"])
        except ValueError as e:  # prompts that tokenize to different lengths, answers sharing a token
            raise ConfigError(f"task pairs ({kwargs['path']}): {e}") from None
    if kwargs["seed"] is None:  # the run's seed draws the suite unless the task pins one
        kwargs["seed"] = cfg.seed
    try:
        return list(tasks.build_suite(tokenizer=model.tokenizer, chat=use_chat(cfg, model), **kwargs))
    except ValueError as e:  # a length below the prompt's skeleton, outcomes this tokenizer merges
        raise ConfigError(f"task {cfg.task.name!r}: {e}") from None


def item_key(item: Any, index: int) -> str:
    """A unit key for an item: its `item_id` (or `id`) when it has one, else its index."""
    ident = getattr(item, "item_id", None) or getattr(item, "id", None)
    if ident is None and isinstance(item, Mapping):
        ident = item.get("item_id", item.get("id"))
    return f"item-{index:05d}" if ident is None else f"item-{ident}"


@dataclasses.dataclass
class Context:
    """What an experiment's `run(ctx)` receives: the job, the model and the unit writer."""

    job: Job
    model: LoadedModel
    writer: RecordWriter
    run_dir: Path

    @property
    def name(self) -> str:
        return self.job.name

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

    def items(self) -> list[TaskItem]:
        return load_items(self.model, self.cfg)

    def pending(self, keys: Sequence[K], desc: str = "units") -> Iterator[K]:
        """The keys whose unit is not on disk yet, with a progress bar over all of them."""

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

    def done(self, key: object) -> bool:
        return self.writer.done(key)

    def write(self, key: object, records: Iterable[Mapping[str, Any]]) -> None:
        self.writer.write(key, records)

    def read(self) -> pd.DataFrame:
        return self.writer.read()

    def write_json(self, filename: str, obj: Any) -> None:
        write_json(self.run_dir / filename, obj)
