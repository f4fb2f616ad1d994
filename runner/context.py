"""The runner's side of a job: the model it loads, the task items it builds (their lengths checked
first, with the tokenizer alone), the Context an experiment receives (the shape of
experiments.shared.context.Context)."""

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
from kvnotes.models import (
    LoadedModel,
    WeightsError,
    get_spec,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from kvnotes.models.loading import has_chat
from kvnotes.models.tiny import tiny_model, tiny_tokenizer
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


def preflight_tokenizer(cfg: RunConfig) -> Any | None:
    """The tokenizer the configured model loads with, read without its weights: a tiny model's,
    or a packaged model's (from its converted folder, else its GGUF); None for a hub model, or one
    whose files are not on this machine yet (its load then fetches them or says what is missing)."""
    if cfg.model.tiny_family is not None:
        return tiny_tokenizer()
    if get_spec(cfg.model.name).source != "package":
        return None
    try:
        return load_tokenizer(cfg.model.name, cfg.cache_dir)
    except (WeightsError, OSError, ValueError) as e:
        log.info("prompt lengths are checked when the model has loaded (no tokenizer yet: %s)", e)
        return None


SuiteCheck = tuple[str, str, dict[str, Any]]  # what, the setting to raise, build_suite's kwargs


def suite_checks(job: Job) -> list[SuiteCheck]:
    """Every suite the job builds from its config: the task group's (a probe, or an experiment
    with READS_TASK) and the job config's own (`suite_lengths()`: setting, suite, n_items, length)."""
    cfg, out = job.cfg, []
    if job.entry.reads_task and cfg.task is not None and cfg.task.KIND != "pairs":  # a prompts file is used as written
        kwargs = cfg.task.build_kwargs()
        if kwargs["seed"] is None:  # the run's seed draws the suite unless the task pins one
            kwargs["seed"] = cfg.seed
        out.append((f"task {cfg.task.name!r}", "task.length", kwargs))
    own = getattr(job.params, "suite_lengths", None)
    if callable(own):
        for setting, suite, n_items, length in own():
            out.append((f"{job.kind}.{setting} (suite {suite!r})", f"{job.kind}.{setting}",
                        {"suite": suite, "n_items": n_items, "length": length, "seed": cfg.seed}))
    return out


def check_lengths(job: Job) -> None:
    """ConfigError when a suite's prompts need more tokens than the job gives them, before any
    weights load or run directory is made: each item's skeleton tokenized by the model's own
    tokenizer (`kvnotes.tasks.required_length`, milliseconds). Without a tokenizer yet the build
    after the load says it (`load_items`)."""
    checks = suite_checks(job)
    tok = preflight_tokenizer(job.cfg) if checks else None
    if tok is None:
        return
    spec = None if job.cfg.model.tiny_family is not None else get_spec(job.cfg.model.name)
    chat = bool(job.cfg.model.chat and has_chat(spec, tok))  # as use_chat on the loaded model
    for what, setting, kwargs in checks:
        length = kwargs.pop("length")
        try:
            need, item = tasks.required_length(tokenizer=tok, chat=chat, **kwargs)
        except ValueError as e:  # outcomes this tokenizer merges, a suite that cannot be built
            raise ConfigError(f"{what}: {e}") from None
        if length < need:
            raise ConfigError(f"{what}: length {length} is below the {need} tokens item {item} needs "
                              f"without filler; use {setting} >= {need}")


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
