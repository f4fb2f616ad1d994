"""Probe `scrub`: causal scrubbing of the note hypothesis, note vs rest.

Hypothesis H: the field reaches the decision only through a set N of note positions, fixed before
any patching: the aggregator tokens after the field (`aggregators`), or the downstream positions
the decision token attends to most on the new cache (`attended`, the knockout's top set).
Scrubbing keeps what H says matters and resamples everything else from the other input: `note`
reads the decision from the old (stale) cache with the new run's K/V at N only, the field itself
left old; `rest` takes the new K/V at every changed position (field to end) except N. Under H
note = 1 and rest = 0 (paper: 0.79 vs 0.19); 1 - note - rest measures what neither carries
alone (interaction). `random`: |N| random downstream positions (draws averaged per item), what a
set of that size does by chance.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.measure.metrics import ci_dict
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes.parts.common import (
    attended_positions,
    attention_to_cache,
    pair_fields,
    run_pairs,
    skip_summary,
)
from probes.parts.readouts import paired_difference, per_item

NOTE_SETS = ("aggregators", "attended")


@dataclass
class ScrubConfig:
    margin: float | None = None  # None: the model config's margin
    notes: list[str] = field(default_factory=lambda: list(NOTE_SETS))
    top_fraction: float = 0.25  # `attended`: this share of the downstream span, most attended first
    n_random: int = 3
    seed: int = 0
    batch_size: int | None = None  # patched variants per forward; None: as many as half the free memory holds
    unit_size: int = 1

    def __post_init__(self) -> None:
        bad = [n for n in self.notes if n not in NOTE_SETS]
        if bad or not self.notes:
            raise ValueError(f"unknown note sets {bad}; valid: {', '.join(NOTE_SETS)}")
        if not 0 < self.top_fraction <= 1 or self.n_random < 0 or (self.batch_size is not None and self.batch_size < 1):
            raise ValueError("top_fraction in (0, 1], n_random >= 0, batch_size >= 1")


def note_set(pair: PatchPair, kind: str, att: torch.Tensor | None, top_fraction: float) -> list[int]:
    """The positions hypothesised to carry the notes, chosen without looking at any patch."""
    down = pair.downstream_positions
    if kind == "aggregators":
        return [p for p in pair.item.aggregators if down and down[0] <= p <= down[-1]]
    assert att is not None
    return attended_positions(pair, att, top_fraction)


def item_records(model: LoadedModel, pair: PatchPair, cfg: ScrubConfig, margin: float) -> list[dict[str, Any]]:
    rng = random.Random(f"{cfg.seed}/{pair.item.item_id}")
    att = attention_to_cache(model, pair) if "attended" in cfg.notes else None  # [layer, head, pos]
    base = pair_fields(pair, margin)
    rows: list[dict[str, Any]] = []
    states: list[list[int]] = []
    for kind in cfg.notes:
        notes = note_set(pair, kind, att, cfg.top_fraction)
        rest = sorted(set(pair.field_to_end) - set(notes))
        n = len(notes)
        rows += [base | {"condition": "note", "notes": kind, "n_positions": n},
                 base | {"condition": "rest", "notes": kind, "n_positions": len(rest)}]
        states += [notes, rest]
        for d in range(cfg.n_random if n <= len(pair.downstream_positions) else 0):
            rows.append(base | {"condition": "random", "notes": kind, "n_positions": n, "draw": d})
            states.append(sorted(rng.sample(pair.downstream_positions, n)))
    scores = patched_scores(model, pair, states, batch_size=cfg.batch_size)
    for row, s, r in zip(rows, scores, recoveries(pair, scores), strict=True):
        row["score"], row["recovery"] = float(s), float(r)
    return rows


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: ScrubConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


def _per_item(records: Sequence[Mapping[str, Any]], cond: str, kind: str, key: str = "recovery") -> dict[str, float]:
    return per_item(records, lambda r: r.get("condition") == cond and r.get("notes") == kind, key)


def summarize(records: Sequence[Mapping[str, Any]], cfg: ScrubConfig) -> dict[str, Any]:
    out = skip_summary(records)
    kinds = sorted({r["notes"] for r in records if isinstance(r.get("notes"), str)})
    for kind in kinds:
        note, rest, rand = (_per_item(records, c, kind) for c in ("note", "rest", "random"))
        both = sorted(set(note) & set(rest))
        out[kind] = {
            "note": ci_dict(note.values()), "rest": ci_dict(rest.values()), "random": ci_dict(rand.values()),
            "interaction": ci_dict(1.0 - note[i] - rest[i] for i in both),  # 0 when note + rest = 1
            "note_minus_random": paired_difference(note, rand),
            "n_note_positions": ci_dict(_per_item(records, "note", kind, "n_positions").values()),
        }
    out["paper"] = {"note": 0.79, "rest": 0.19}
    if kinds:
        out["reading"] = "; ".join(f"{k}: note {out[k]['note']['mean']:.2f} vs rest {out[k]['rest']['mean']:.2f} "
                                   f"(n={out[k]['note']['n']})" for k in kinds) + " (paper 0.79 vs 0.19)"
    return out


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "scrub"
CONFIG = ScrubConfig
HELP = "causal scrubbing of the note hypothesis: note positions alone vs everything else"
