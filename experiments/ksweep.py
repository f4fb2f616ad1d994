"""Experiment `ksweep`: selective@K, the field plus K note positions, copied or recomputed,
ranked by effect (needs the oracle) or by attention; the edit experiment's driver and records.

    python -m experiments.run +experiment=ksweep model=qwen-1.5b task=gated
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.shared.edits import drive, summarize_states
from kvnotes.edit.strategies import Editor, EditState

if TYPE_CHECKING:
    from experiments.shared.context import Context


@dataclass
class KSweepConfig:
    ks: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64])
    variants: list[str] = field(default_factory=lambda: ["copy", "recompute"])
    rankings: list[str] = field(default_factory=lambda: ["effect", "attention"])
    margin: float | None = None

    def __post_init__(self) -> None:
        if any(k < 0 for k in self.ks) or not set(self.variants) <= {"copy", "recompute"}:
            raise ValueError("ks >= 0; variants among copy, recompute")
        if not set(self.rankings) <= {"effect", "attention"}:
            raise ValueError("rankings among effect, attention")


def _states(ed: Editor, cfg: KSweepConfig) -> tuple[list[EditState], list[dict[str, Any]]]:
    ranks = {"effect": ed.rank_by_effect() if "effect" in cfg.rankings else [],
             "attention": ed.rank_by_attention() if "attention" in cfg.rankings else []}
    states, extra = [], []
    for rk in cfg.rankings:
        for var in cfg.variants:
            for k in cfg.ks:
                states.append(ed.selective(ranks[rk][:k], var, f"{var}/{rk}"))
                extra.append({"k": k, "variant": var, "ranking": rk})
    return states, extra


def summarize(records: Sequence[Mapping[str, Any]], cfg: KSweepConfig) -> dict[str, Any]:
    return summarize_states([r for r in records if r["strategy"] not in ("stale", "oracle")], ("strategy", "k"))


def run(ctx: Context) -> None:
    cfg: KSweepConfig = ctx.params
    drive(ctx, lambda ed: _states(ed, cfg), cfg.margin)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "ksweep"
CONFIG = KSweepConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = "selective@K sweep: field + K note positions, copy vs recompute, by effect vs attention"
