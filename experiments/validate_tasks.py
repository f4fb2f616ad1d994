"""Experiment `validate_tasks`: which task items does this model condition on?

For each item of the configured suite (`task=<suite>`): outcome logits under the old and new
prompt, |score_new - score_old|, argmax correctness under both values. An item is usable for
recovery when |delta| >= margin (the model config's margin unless this config sets one), and
for P(correct) when, in addition, both argmax decisions are correct. Writes one record per
item, usable_ids.json (what probes read to skip the rest) and a per-domain summary.

    python -m experiments.run +experiment=validate_tasks model=qwen-1.5b task=gated
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvnotes.measure import runfiles
from kvnotes.tasks import summarize as summarize_records
from kvnotes.tasks.scoring import decision_logits, score_item
from kvnotes.tasks.validate import record, usable_ids

if TYPE_CHECKING:
    from experiments.shared.context import Context

USABLE_IDS = "usable_ids.json"


@dataclass
class ValidateTasksConfig:
    """margin: None takes the model config's margin (never lowered silently: it is reported)."""

    margin: float | None = None

    def __post_init__(self) -> None:
        if self.margin is not None and not self.margin >= 0:
            raise ValueError(f"margin must be >= 0 or null, got {self.margin}")


def _clean(r: dict[str, Any]) -> dict[str, Any]:
    """Records read back from parquet: NaN skip reasons -> None, numpy scalars -> Python."""
    out = {}
    for k, v in r.items():
        if hasattr(v, "item") and not hasattr(v, "__len__"):
            v = v.item()
        if k.startswith("skip_") and isinstance(v, float) and math.isnan(v):
            v = None
        out[k] = v
    return out


def summarize(records: list[dict[str, Any]], cfg: ValidateTasksConfig) -> dict[str, Any]:
    """n_items, n_usable, margin, skips by reason, and per domain accuracy / flip rate / |delta|."""
    rows = [_clean(r) for r in records]
    out = summarize_records(rows)
    out["usable_ids_file"] = USABLE_IDS
    return out


def run(ctx: Context) -> None:

    params: ValidateTasksConfig = ctx.params
    margin = ctx.model.margin if params.margin is None else params.margin
    items = ctx.items()
    by_key = {f"item-{it.item_id}": it for it in items}
    if len(by_key) != len(items):
        raise ValueError("task items have duplicate ids")
    for key in ctx.pending(list(by_key), desc="validate items"):
        it = by_key[key]
        rec = record(it, score_item(it, decision_logits(ctx.model, it)), margin)
        ctx.write(key, [rec])
    rows = [_clean(r) for r in ctx.read().to_dict("records")]
    ctx.write_json(USABLE_IDS, {"model": ctx.cfg.model.name, **usable_ids(rows)})


def _suite_of(run_dir: Any) -> str:

    cfg = yaml.safe_load((run_dir / runfiles.CONFIG).read_text())
    return str((cfg.get("task") or {}).get("name", "?"))


def markdown_table(run_dirs: list[str]) -> str:
    """Per model and domain: accuracy old/new, flip rate, mean |delta|, n usable (README table)."""

    head = ("| model | dtype | suite | domain | n | acc_old | acc_new | flip | raw acc_old | raw acc_new"
            " | raw flip | mean abs delta | usable (recovery) | usable (P(correct)) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for d in map(Path, run_dirs):
        s = json.loads((d / runfiles.SUMMARY).read_text())
        meta = json.loads((d / runfiles.META).read_text())
        suite = _suite_of(d)
        rows = {**s["per_domain"], "**all**": s["overall"]}
        for dom, g in rows.items():
            lines.append(
                f"| {s['model']} | {meta.get('dtype', '?')} | {suite} | {dom} | {g['n']} "
                f"| {g['accuracy_old']:.2f} | {g['accuracy_new']:.2f} | {g['flip_rate']:.2f} "
                f"| {g['raw_accuracy_old']:.2f} | {g['raw_accuracy_new']:.2f} | {g['raw_flip_rate']:.2f} "
                f"| {g['mean_abs_delta']:.2f} | {g['n_usable']} | {g['n_usable_correct']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(markdown_table(sys.argv[1:]))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "validate_tasks"
CONFIG = ValidateTasksConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = "accuracy, flip rate and |score delta| per domain; writes the usable item ids"
