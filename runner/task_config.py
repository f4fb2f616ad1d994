"""Typed task group: one schema per suite kind, so a bad task key fails before any model loads.

`task=<suite>` picks configs/task/<suite>.yaml, which lists `/schema/task/<kind>@_here_` first:
Hydra then types the group (a misspelt key such as `+task.nitems=4`, or `task.n_items=abc`,
fails at composition). `typed_task` builds the dataclass, whose `__post_init__` checks values
and reads the suite file (YAML only: `kvnotes.tasks.load_suite` checks its domains and rules),
so a suite that does not exist, is of another kind, or states a rule wrongly is refused too.
Agent scenarios have no task schema: the `agent` experiment builds them from its own config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from kvnotes.errors import ConfigError
from kvnotes.pairs.file import read_pairs_file
from kvnotes.tasks import UnknownSuiteError, load_suite


@dataclass
class GatedDesign:
    """Overrides of the suite file's prompt design (kvnotes.tasks.Design); null keeps the file's."""

    rule_position: str | None = None  # policy | question
    fewshot: int | None = None  # even, >= 0
    answer_prefix: bool | None = None
    point_to_field: bool | None = None


@dataclass
class SkillsDesign:
    fewshot: int | None = None  # worked examples per skill block (even, >= 0); null: the file's


@dataclass
class TaskConfig:
    """What every suite kind shares: which suite file, how many items of how many tokens."""

    KIND: ClassVar[str] = ""
    name: str = MISSING  # a suite file <name>.yaml in kvnotes/tasks/templates/ or template_dirs
    kind: str = MISSING  # fixed by the schema; must match the suite file's `kind`
    n_items: int = 48
    length: int = 400  # tokens per prompt, met within a few tokens; bounded by the model
    seed: int | None = None  # null: the run's seed
    template_dirs: list[str] = field(default_factory=list)  # more directories of suite files

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise ConfigError(f"task.kind is fixed to {self.KIND!r} by the schema, got {self.kind!r}")
        if self.n_items < 1:
            raise ConfigError(f"task.n_items must be >= 1, got {self.n_items}")
        if self.length < 1:
            raise ConfigError(f"task.length must be >= 1 token, got {self.length}")
        if self.seed is not None and self.seed < 0:
            raise ConfigError(f"task.seed must be >= 0 or null (the run's seed), got {self.seed}")
        self.suite()  # exists, parses, is of this kind

    def suite(self) -> Any:
        """The suite file, read and checked (kvnotes.tasks.Suite); raises ConfigError."""

        try:
            s = load_suite(self.name, self.template_dirs)
        except UnknownSuiteError as e:
            raise ConfigError(f"task.name: {e}") from None
        except (ValueError, TypeError, OSError) as e:  # a suite file that does not check out
            raise ConfigError(f"task {self.name!r}: {e}") from None
        if s.kind != self.KIND:
            raise ConfigError(f"task.name={self.name!r} is a {s.kind} suite, but task is typed as "
                              f"{self.KIND}: {KIND_HINT.get(s.kind, f'use task=<a {s.kind} suite>')}")
        return s

    def build_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `kvnotes.tasks.build_suite` (tokenizer and chat aside)."""
        return {"suite": self.name, "n_items": self.n_items, "length": self.length, "seed": self.seed,
                "template_dirs": list(self.template_dirs)}


@dataclass
class GatedTask(TaskConfig):
    """A gated suite (gated, gated-control, gated-polarity, gated-trigger, or a user's)."""

    KIND: ClassVar[str] = "gated"
    kind: str = "gated"
    domains: list[str] | None = None  # a subset of the suite's domains; null: all of them
    design: GatedDesign = field(default_factory=GatedDesign)

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.suite()
        if self.domains is not None:
            known = [d.name for d in s.domains]
            bad = [d for d in self.domains if d not in known]
            if bad or not self.domains:
                raise ConfigError(f"task.domains: {bad or '[]'} not in suite {self.name!r}; valid: "
                                  f"{', '.join(known)}")
        try:
            design = dataclasses.replace(s.design, **self.design_overrides())
        except ValueError as e:
            raise ConfigError(f"task.design: {e}") from None
        if s.variant == "trigger" and design.fewshot:
            raise ConfigError("task.design.fewshot must be 0 for a trigger suite: demonstrations "
                              "would contradict one of its rules")

    def design_overrides(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self.design).items() if v is not None}

    def build_kwargs(self) -> dict[str, Any]:
        return super().build_kwargs() | {"domains": self.domains,
                                         "design": self.design_overrides() or None}


@dataclass
class SkillsTask(TaskConfig):
    """Skill blocks and a question one skill decides (the composition experiments' items)."""

    KIND: ClassVar[str] = "skills"
    kind: str = "skills"
    n_items: int = 40
    length: int = 600
    design: SkillsDesign = field(default_factory=SkillsDesign)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.design.fewshot is not None and (self.design.fewshot < 0 or self.design.fewshot % 2):
            raise ConfigError(f"task.design.fewshot must be an even number >= 0, got {self.design.fewshot}")

    def build_kwargs(self) -> dict[str, Any]:
        design = {"fewshot": self.design.fewshot} if self.design.fewshot is not None else None
        return super().build_kwargs() | {"design": design}


@dataclass
class MemoryTask(TaskConfig):
    """A conversation log, then a user profile with one mutable fact."""

    KIND: ClassVar[str] = "memory"
    kind: str = "memory"
    n_items: int = 40
    length: int = 600


@dataclass
class PairsTask(TaskConfig):
    """A file of your own prompt pairs (kvnotes.pairs.file), used verbatim: no suite, no layout.

    `n_items` 0 takes every pair; `length` is set from the file (its longest prompt in characters,
    an upper bound on its tokens, plus the chat template's) for the position and memory checks."""

    KIND: ClassVar[str] = "pairs"
    name: str = "pairs"
    kind: str = "pairs"
    path: str = MISSING  # the prompts file: one JSON object a line (clean, corrupt, answers, ...)
    n_items: int = 0

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise ConfigError(f"task.kind is fixed to {self.KIND!r} by the schema, got {self.kind!r}")
        if self.n_items < 0:
            raise ConfigError(f"task.n_items must be >= 0 (0: every pair of the file), got {self.n_items}")
        lines = read_pairs_file(self.path)  # checked whole, before any model loads
        self.n_items = min(self.n_items or len(lines), len(lines))

        def chars(v: Any) -> int:
            return len(v) if not isinstance(v, list) or not v or not isinstance(v[0], dict) else \
                sum(len(m["content"]) for m in v)
        self.length = max(chars(o[k]) for o in lines[: self.n_items] for k in ("clean", "corrupt")) + 64

    def suite(self) -> Any:
        return None

    def build_kwargs(self) -> dict[str, Any]:
        return {"path": self.path, "n_items": self.n_items}


SCHEMAS: dict[str, type[TaskConfig]] = {c.KIND: c for c in (GatedTask, SkillsTask, MemoryTask, PairsTask)}
KIND_HINT = {
    "agents": "agent scenarios are built by +experiment=agent from its own config, not from task",
    **{k: f"use task={k} task.name=<suite>" for k in SCHEMAS},
}


def kind_of(node: DictConfig | dict[str, Any]) -> str:
    """The schema kind of a composed task node: its schema's, its `kind`, else the suite file's."""
    typed = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if isinstance(typed, type) and issubclass(typed, TaskConfig) and typed.KIND:
        return typed.KIND
    kind = node.get("kind")
    if kind is not None and kind != MISSING:
        return str(kind)
    if node.get("path") is not None and node.get("name") in (None, "pairs"):
        return "pairs"

    try:
        return load_suite(str(node.get("name")), list(node.get("template_dirs") or ())).kind
    except UnknownSuiteError as e:
        raise ConfigError(f"task.name: {e}") from None
    except (ValueError, TypeError, OSError) as e:
        raise ConfigError(f"task {node.get('name')!r}: {e}") from None


def schema_for(kind: str) -> type[TaskConfig]:
    if kind not in SCHEMAS:
        raise ConfigError(f"no task schema for suite kind {kind!r}; valid kinds: {', '.join(SCHEMAS)}; "
                          f"{KIND_HINT.get(kind, '')}".rstrip("; "))
    return SCHEMAS[kind]
