"""What an experiment's `run(ctx)` may use: the Context protocol, and nothing of the runner.

The runner (runner/context.py) hands every experiment an object with this shape; experiments
type against it here and never import the runner. A probe gets plainer arguments instead:
`run(model, items, cfg)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pandas as pd

from kvnotes.models import LoadedModel
from kvnotes.tasks.item import TaskItem

K = TypeVar("K")


class ModelSettings(Protocol):
    """The model group of the run's config (configs/model/<name>.yaml)."""

    name: str
    dtype: str
    margin: float  # minimum |score_new - score_old| for an item to count as usable
    tiny_family: str | None


class TaskSettings(Protocol):
    """The task group (configs/task/<suite>.yaml), typed and validated by the runner."""

    name: str
    n_items: int
    length: int
    seed: int | None

    def build_kwargs(self) -> dict[str, Any]: ...


class Settings(Protocol):
    """The run-wide settings an experiment reads."""

    seed: int
    cache_dir: str | None
    progress: bool

    @property
    def model(self) -> ModelSettings: ...

    @property
    def task(self) -> TaskSettings | None: ...


class Context(Protocol):
    """One run of one experiment: its model, its settings, and resumable units on disk."""

    model: LoadedModel
    run_dir: Path

    @property
    def name(self) -> str:
        """The job's name (`+experiment=<name>`)."""
        ...

    @property
    def cfg(self) -> Settings: ...

    @property
    def params(self) -> Any:
        """The experiment's own config: an instance of its module's CONFIG."""
        ...

    @property
    def chat(self) -> bool:
        """Render prompts with the chat template (asked for, and the tokenizer has one)."""
        ...

    def items(self) -> list[TaskItem]:
        """The configured task suite's items, built for this model's tokenizer."""
        ...

    def pending(self, keys: Sequence[K], desc: str = "units") -> Iterator[K]:
        """The keys whose unit is not on disk yet (a resumed run skips the others)."""
        ...

    def done(self, key: object) -> bool: ...

    def write(self, key: object, records: Iterable[Mapping[str, Any]]) -> None:
        """One unit's records, written atomically: on disk wholly or not at all."""
        ...

    def read(self) -> pd.DataFrame:
        """Every record written so far."""
        ...

    def write_json(self, filename: str, obj: Any) -> None:
        """A JSON file of the run's own in the run dir (atomic)."""
        ...
