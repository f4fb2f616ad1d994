"""Experiment `wording`: does the erratum's wording matter? Bare, tagged, explicit override,
disregard-and-re-evaluate, optionally under the field-only edit; the edit experiment's driver.

    python -m experiments.run +experiment=wording model=qwen-1.5b task=gated
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.shared.edits import drive, summarize_states
from kvnotes.edit.strategies import ERRATA

if TYPE_CHECKING:
    from experiments.shared.context import Context


@dataclass
class WordingConfig:
    wordings: list[str] = field(default_factory=lambda: list(ERRATA))
    with_field: bool = False  # also apply the field-only edit under each erratum
    margin: float | None = None

    def __post_init__(self) -> None:
        bad = [w for w in self.wordings if w not in ERRATA]
        if bad:
            raise ValueError(f"unknown wordings {bad}; valid: {', '.join(ERRATA)}")


def summarize(records: Sequence[Mapping[str, Any]], cfg: WordingConfig) -> dict[str, Any]:
    return summarize_states(records)


def run(ctx: Context) -> None:
    cfg: WordingConfig = ctx.params
    drive(ctx, lambda ed: ([ed.erratum(w, with_field=cfg.with_field) for w in cfg.wordings], None), cfg.margin)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "wording"
CONFIG = WordingConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = "erratum wording ablation: bare, tagged, explicit override, disregard-and-re-evaluate"
