"""Probe `patching`: where does the decision live? Locality patching on the KV cache.

Per usable item: recovery of stale (0), field-only (the field's own K/V from the new run),
notes-only (everything after the field, the field itself left stale: false-note injection,
the decision should follow the pasted notes), full-downstream (the field and everything after
it) and oracle (1); the per-position map (one
position, all layers, new into old) and per-layer recovery (one layer's K/V over the positions
after the field). The paper finds field-only ~ 0 and full-downstream = 1: the field's conclusion
is memoised in downstream "note" tokens. Positions before the field hold identical K/V in both
runs, so their recovery is exactly 0 and they are not run. Dissociation: on `task=gated-trigger`
the mutable span is a rule trigger word (the field is byte-identical), so field-only reads as
trigger-only and notes-only as the notes. Each condition's recovery carries, beside the item
bootstrap, `ci_cluster`: the bootstrap over domains (whole domains resampled), since items of one
domain share its templates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes.parts.common import (
    by_condition,
    cluster_ci,
    curve,
    pair_fields,
    run_pairs,
    skip_summary,
    token_texts,
)

CONDITIONS = ("stale", "field_only", "notes_only", "full_downstream", "oracle")


@dataclass
class PatchingConfig:
    margin: float | None = None  # None: the model config's margin
    per_position: bool = True  # the per-position map (one variant per downstream position)
    per_layer: bool = True
    batch_size: int | None = None  # patched variants per forward; None: as many as half the free memory holds
    unit_size: int = 1  # items per resumable unit
    n_boot: int = 2000

    def __post_init__(self) -> None:
        if self.margin is not None and self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if (self.batch_size is not None and self.batch_size < 1) or self.unit_size < 0:
            raise ValueError("batch_size must be >= 1 and unit_size >= 0")



def item_records(
    model: LoadedModel, pair: PatchPair, cfg: PatchingConfig, margin: float
) -> list[dict[str, Any]]:
    """All patching records of one usable item."""
    item = pair.item
    base = pair_fields(pair, margin)
    states = [[], pair.field_positions, pair.downstream_positions, pair.field_to_end,
              list(range(pair.n_cached))]
    scores = patched_scores(model, pair, states, batch_size=cfg.batch_size)
    rec = recoveries(pair, scores)
    out = [base | {"condition": c, "score": float(s), "recovery": float(r)}
           for c, s, r in zip(CONDITIONS, scores, rec, strict=True)]
    if cfg.per_layer:
        down = pair.downstream_positions
        layers = list(range(model.n_layers))
        s = patched_scores(model, pair, [down] * len(layers), [[layer] for layer in layers], batch_size=cfg.batch_size)
        out += [base | {"condition": "layer", "layer": layer, "rel_layer": layer / (len(layers) - 1),
                        "score": float(a), "recovery": float(b)}
                for layer, a, b in zip(layers, s, recoveries(pair, s), strict=True)]
    if cfg.per_position:
        out.append(base | {"condition": "tokens", "tokens": token_texts(model, item.old_ids),
                           "new_tokens": token_texts(model, item.new_ids[slice(*item.field_span)])})
        positions = pair.field_to_end
        s = patched_scores(model, pair, [[p] for p in positions], batch_size=cfg.batch_size)
        tokens = token_texts(model, [item.old_ids[p] for p in positions])
        aggregators = set(item.aggregators)
        out += [base | {"condition": "position", "position": p, "token": t,
                        "in_field": p < item.field_span[1], "is_aggregator": p in aggregators,
                        "score": float(a), "recovery": float(b)}
                for p, t, a, b in zip(positions, tokens, s, recoveries(pair, s), strict=True)]
    return out


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: PatchingConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


def reading(recovery: Mapping[str, Mapping[str, Any]], n_usable: int) -> str | None:
    """One line on what the recoveries mean; thresholds fixed with the probe, not with a result:
    the paper's picture is field-only CI below 0.2 with notes-only CI above 0.8."""
    fo, no, fd = (recovery.get(c) or {} for c in ("field_only", "notes_only", "full_downstream"))
    if not (n_usable and fo.get("n") and no.get("n")):
        return None

    def cell(r: Mapping[str, Any]) -> str:
        return f"{r['mean']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"
    if fo["ci_hi"] < 0.2 and no["ci_lo"] > 0.8:
        what = "the decision is read from the notes after the field, not from the field (the paper's picture)"
    elif fo["ci_lo"] > 0.5 and no["ci_hi"] < 0.5:
        what = "the decision is read from the field itself; the notes after it carry little (unlike the paper)"
    elif fo["ci_hi"] < 0.5 and no["ci_lo"] > 0.5:
        field = (f"the field's own K/V at most a little (its CI reaches 0 and {fo['ci_hi']:.2f})"
                 if fo["ci_lo"] <= 0.0 else "the field's own K/V some")
        what = f"the notes after the field carry most of the decision, {field} (near the paper's picture)"
    else:
        what = "both the field and the notes after it carry part of the decision (neither picture alone)"
    return (f"over {n_usable} usable items, patching only the field's K/V moves the decision {cell(fo)} of "
            f"the way from the old value's to the new one's, only the K/V after the field {cell(no)}, both "
            f"{cell(fd) if fd.get('n') else 'n/a'}: {what}.")


def summarize(records: Sequence[Mapping[str, Any]], cfg: PatchingConfig) -> dict[str, Any]:
    out = skip_summary(records)
    out["recovery"] = by_condition(records, CONDITIONS, n_boot=cfg.n_boot)
    for c in CONDITIONS:  # beside the item interval: resampling whole domains (items share templates)
        rows = [r for r in records if r.get("condition") == c]
        if rows:
            out["recovery"][c]["ci_cluster"] = cluster_ci(rows, n_boot=cfg.n_boot)
    text = reading(out["recovery"], out["n_usable"])
    if text:
        out["reading"] = text
    pos = [r for r in records if r.get("condition") == "position"]
    if pos:
        out["per_position"] = {
            "field": by_condition([r for r in pos if r["in_field"]], ["position"])["position"],
            "downstream_aggregator": by_condition([r for r in pos if not r["in_field"] and r["is_aggregator"]], ["position"])["position"],
            "downstream_other": by_condition([r for r in pos if not r["in_field"] and not r["is_aggregator"]], ["position"])["position"],
        }
    if any(r.get("condition") == "layer" for r in records):
        out["per_layer"] = curve(records, "layer", "layer", n_boot=cfg.n_boot)
    return out


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "patching"
CONFIG = PatchingConfig
HELP = "locality patching: field-only vs full-downstream, per-position and per-layer maps"
