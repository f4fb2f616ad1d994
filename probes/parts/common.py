"""What every cache probe shares: item usability by margin, record stamping, summaries with CIs.

Intervals: means get the percentile bootstrap of kvnotes.measure.metrics (rows of one item, such as
random draws or positions, averaged per item first, so n counts items); 0/1 outcomes get a
Wilson interval (`prop_dict`). An item is usable when |score_new - score_old| >= the model's
margin; the summary states the margin and the rule it came from (kvnotes.measure.margins), and when no
item is usable it says so in one line with what to try. Beside them, the small readouts several
probes use: layer bands, the prompt segment of a position, the decision token's attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from kvnotes.edit import ranking
from kvnotes.edit.patching import PatchPair, make_pair
from kvnotes.measure import margins
from kvnotes.measure.metrics import ci_dict, cluster_bootstrap_ci
from kvnotes.models import LoadedModel
from kvnotes.tasks.item import TaskItem


def token_texts(model: LoadedModel, ids: Sequence[int]) -> list[str]:
    """Each token of `ids` decoded alone ('' for every token when the model has no tokenizer)."""
    return [model.tokenizer.decode([i]) for i in ids] if model.tokenizer is not None else [""] * len(ids)


def pair_fields(pair: PatchPair, margin: float) -> dict[str, Any]:
    """The columns every record of a patched pair carries: the item's, the margin, both scores."""
    return item_fields(pair.item) | {"margin": margin, "score_stale": pair.score_stale,
                                     "score_oracle": pair.score_oracle}


def item_fields(item: TaskItem) -> dict[str, Any]:
    return {
        "item_id": item.item_id,
        "suite": item.suite,
        "domain": item.domain,
        "template_id": item.template_id,
        "variant": item.variant,
        "n_tokens": item.n_tokens,
        "field_start": item.field_span[0],
        "field_end": item.field_span[1],
    }


def skip_reason(pair: PatchPair, margin: float) -> str | None:
    """Why an item cannot measure recovery: the model's decision barely depends on the field
    (the library's gate, kvnotes.measure.margins.unusable)."""
    return margins.unusable(pair.delta, margin)


def run_pairs(
    model: LoadedModel,
    items: Iterable[TaskItem],
    margin: float | None,
    records_of: Callable[[PatchPair, float], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The loop every cache probe shares: stale/oracle pair per item, skip it below the margin
    (one `skipped` record saying why), else the probe's own records."""
    m = resolve_margin(model, margin)
    rule = margin_rule(model, margin)
    records: list[dict[str, Any]] = []
    for item in items:
        pair = make_pair(model, item)
        reason = skip_reason(pair, m)
        records += [skipped_record(pair, m, reason)] if reason else records_of(pair, m)
    return [r if "margin_rule" in r else r | {"margin_rule": rule} for r in records]


def margin_rule(model: LoadedModel, margin: float | None) -> str:
    """Where the margin came from, in words: the probe's own setting, or the model's (derived
    by the rule of kvnotes.measure.margins, or set by hand)."""
    if margin is not None:
        return f"set by the probe config (probe.margin={float(margin):g})"
    dtype = str(model.dtype).removeprefix("torch.")
    return margins.describe(model.spec.name if model.spec else model.name, dtype, model.margin)


def skipped_record(pair: PatchPair, margin: float, reason: str) -> dict[str, Any]:
    return {
        **item_fields(pair.item),
        "condition": "skipped",
        "reason": reason,
        "margin": margin,
        "score_stale": pair.score_stale,
        "score_oracle": pair.score_oracle,
    }


def resolve_margin(model: LoadedModel, margin: float | None) -> float:
    """The probe's margin, else the model's (the run's model.margin, which the runner resolves
    from kvnotes.measure.margins: the same number experiments read)."""
    return float(margin) if margin is not None else model.margin


def skip_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of usable and skipped items, with the margin the records were judged by and its
    rule; with no usable item, `no_usable` says in one line what to try."""
    margin_values = sorted({float(r["margin"]) for r in records if "margin" in r})
    items = {r["item_id"] for r in records}
    skipped = [r for r in records if r.get("condition") == "skipped"]
    reasons: dict[str, int] = {}
    for r in skipped:
        key = str(r["reason"]).split(" = ")[0] + " < margin"
        reasons[key] = reasons.get(key, 0) + 1
    rules = sorted({str(r["margin_rule"]) for r in records if isinstance(r.get("margin_rule"), str)})
    out: dict[str, Any] = {
        "margin": margin_values[0] if len(margin_values) == 1 else margin_values,
        "margin_rule": rules[0] if len(rules) == 1 else (rules or "not recorded"),
        "n_items": len(items),
        "n_usable": len(items) - len({r["item_id"] for r in skipped}),
        "n_skipped": len({r["item_id"] for r in skipped}),
        "skip_reasons": reasons,
    }
    if items and out["n_usable"] == 0:
        top = max((abs(float(r["score_oracle"]) - float(r["score_stale"])) for r in skipped), default=float("nan"))
        out["no_usable"] = margins.no_usable_hint(len(items), out["margin"], top)
    return out


def _per_item(rows: Sequence[Mapping[str, Any]], key: str, n_boot: int) -> dict[str, float | int]:
    """ci_dict over items: the rows of one item (draws, positions) averaged first."""
    units = [r.get("item_id", i) for i, r in enumerate(rows)]
    return ci_dict((float(r[key]) for r in rows), n_boot, units=units)


def by_condition(
    records: Sequence[Mapping[str, Any]], conditions: Sequence[str], key: str = "recovery",
    n_boot: int = 2000,
) -> dict[str, Any]:
    """Mean of `key` per condition over items (an item's rows averaged first), with CI and n."""
    return {c: _per_item([r for r in records if r.get("condition") == c], key, n_boot) for c in conditions}


def cluster_ci(rows: Sequence[Mapping[str, Any]], key: str = "recovery", cluster: str = "domain",
               n_boot: int = 2000) -> dict[str, Any]:
    """The cluster bootstrap interval of the mean of `key` over items (an item's rows averaged
    first), resampling whole `cluster`s (domains: items of one domain share its templates)."""
    acc: dict[str, list[float]] = {}
    of: dict[str, Any] = {}
    for r in rows:
        acc.setdefault(str(r["item_id"]), []).append(float(r[key]))
        of[str(r["item_id"])] = r.get(cluster)
    ids = sorted(acc)
    means = [sum(acc[i]) / len(acc[i]) for i in ids]
    out = cluster_bootstrap_ci(means, [of[i] for i in ids], n_boot=n_boot)
    return {"cluster": cluster, **{k: v for k, v in out.items() if k != "interval"}}


def curve(records: Sequence[Mapping[str, Any]], condition: str, x: str,
          n_boot: int = 2000) -> list[dict[str, Any]]:
    """Mean recovery with CI at each value of `x` (e.g. layer, or k) for one condition, over items."""
    rows = [r for r in records if r.get("condition") == condition]
    xs = sorted({r[x] for r in rows})
    return [{x: v, **_per_item([r for r in rows if r[x] == v], "recovery", n_boot)} for v in xs]


def bands(n_layers: int) -> dict[str, list[int]]:
    """Early / mid / late thirds of the layers, and all of them."""
    third = [round(i * n_layers / 3) for i in range(4)]
    names = ("early", "mid", "late")
    out = {n: list(range(third[i], third[i + 1])) for i, n in enumerate(names)}
    out["all"] = list(range(n_layers))
    return out


def segment_of(item: TaskItem, pos: int) -> str:
    return next((name for name, (a, b) in item.segments.items() if a <= pos < b), "other")


def attended_positions(pair: PatchPair, att: torch.Tensor, top_fraction: float = 0.25) -> list[int]:
    """The `top_fraction` of the downstream span the decision token attends to most (attention
    `att` [layer, head, pos] averaged over layers and heads; at least one position), sorted."""
    return ranking.top_attended(att, pair.downstream_positions, top_fraction)


def attention_to_cache(model: LoadedModel, pair: PatchPair) -> torch.Tensor:
    """The decision token's attention weights on the new cache: [layer, head, cached pos]."""
    return ranking.decision_attention(model, pair)
