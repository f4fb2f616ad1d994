"""Probe `linear`: at which depth is the conclusion written into the notes, and when is it read?

On the 2x2 polarity items (field value x rule polarity) a prompt's conclusion is independent of
its field value. A logistic regression reads a label from the residual stream (after each layer)
at a token after the field, cross-validated with folds grouped by template so that phrasings never
leak; per-layer accuracy carries a Wilson interval over prompts. Two labels: `truth` (the correct
outcome) and `model` (the outcome the model itself picks: the argmax of the decision logits, not
calibrated), since a model that answers wrongly can still write its own conclusion down. Read at
every aggregator token after the field (newline / punctuation), aligned across prompts by rank
from the last one, reported as the best aggregator (chosen on these same folds, an optimistic
pick) and the mean over aggregators. write depth = first relative layer whose accuracy >=
`threshold` (paper 0.19-0.39); where none reaches it, the summary says how close it came and
where. commit depth = first relative layer from which the logit lens at the decision token (final
norm + unembed) picks the model's final answer among the outcomes and keeps it (paper 0.47-0.75).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvnotes.engine import interp
from kvnotes.measure.metrics import ci_dict, wilson_ci
from kvnotes.models.loading import LoadedModel
from kvnotes.pairs.localize import cv_correct
from kvnotes.tasks.item import TaskItem
from probes.parts.common import segment_of
from probes.parts.readouts import proportion

LABELS = ("truth", "model")


@dataclass
class LinearConfig:
    token: str = "last_aggregator"  # the headline rows: last_aggregator | first_aggregator | decision
    threshold: float = 0.9  # accuracy that counts as "written"
    n_splits: int = 5  # grouped CV folds (fewer when there are fewer templates)
    C: float = 1.0  # inverse L2 strength of the logistic regression
    labels: list[str] = field(default_factory=lambda: list(LABELS))
    aggregators: bool = True  # also probe every aggregator after the field, by rank from the last
    max_aggregators: int | None = None  # None: as many ranks as every prompt has
    unit_size: int = 0  # cross-validation needs every item: one unit

    def __post_init__(self) -> None:
        if self.token not in ("last_aggregator", "first_aggregator", "decision"):
            raise ValueError(f"token={self.token!r}; valid: last_aggregator, first_aggregator, decision")
        if not 0 < self.threshold <= 1 or self.n_splits < 2:
            raise ValueError("threshold in (0, 1] and n_splits >= 2")
        bad = [x for x in self.labels if x not in LABELS]
        if bad or not self.labels:
            raise ValueError(f"labels {bad}; valid: {', '.join(LABELS)}")
        if self.max_aggregators is not None and self.max_aggregators < 1:
            raise ValueError("max_aggregators >= 1 or None")


Which = Literal["old", "new"]


def downstream_aggregators(item: TaskItem) -> list[int]:
    return [p for p in item.aggregators if item.field_span[1] <= p < item.decision_pos]


def probe_position(item: TaskItem, token: str) -> int:
    """The residual position read for the label: an aggregator after the field, or the decision."""
    after = downstream_aggregators(item)
    if token == "decision" or not after:
        return item.decision_pos
    return after[-1] if token == "last_aggregator" else after[0]


def logit_lens_picks(model: LoadedModel, resid: torch.Tensor, item: TaskItem) -> list[str]:
    """Outcome picked by the logit lens at each layer, from the residual at the decision token."""
    norm, unembed = model.adapter.final_norm(model.hf), model.adapter.unembed(model.hf)
    with torch.inference_mode():
        h = resid.to(device=model.device, dtype=model.dtype)  # [layer, d_model]
        logits = unembed(norm(h)).float()  # [layer, vocab]
    ids = torch.tensor(item.decision_ids, device=logits.device)
    return [item.outcomes[i] for i in logits[:, ids].argmax(-1).tolist()]


def commit_layer(picks: Sequence[str]) -> int:
    """First layer from which the picks equal the final layer's pick for good."""
    final, layer = picks[-1], len(picks) - 1
    while layer > 0 and picks[layer - 1] == final:
        layer -= 1
    return layer


FP16_ROOM = 2.0 ** 15  # scaled magnitudes stay below float16's largest finite value (65504)


def fp16_scaled(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[rank, layer, d] as float16 over per-layer power-of-two scales, [layer] float32: x equals
    f16 * scale[:, None] to float16's relative precision. Residual streams can exceed float16's
    range (gemma-3's reach 1e5); a power of two rescales without rounding."""
    peak = x.float().abs().amax(dim=(0, 2)) if x.numel() else torch.zeros(x.shape[1])
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(peak / FP16_ROOM, min=1.0))))
    return (x.float() / scale[None, :, None]).cpu().numpy().astype(np.float16), scale.cpu().numpy()


@dataclass
class Prompt:
    row: dict[str, Any]
    feat: np.ndarray  # [layer, d_model] at the headline position
    aggs: np.ndarray  # [aggregator rank from the last, layer, d_model], float16, over agg_scale
    agg_info: list[tuple[str, float]]  # (segment, position in the downstream span 0..1) per rank
    agg_scale: np.ndarray  # [layer] float32 powers of two: aggregator j's residual is agg(j)

    def agg(self, j: int) -> np.ndarray:
        """Aggregator rank j's residual stream, [layer, d_model] float32."""
        return self.aggs[j].astype(np.float32) * self.agg_scale[:, None]


def prompt_rows(model: LoadedModel, item: TaskItem, cfg: LinearConfig) -> list[Prompt]:
    out = []
    pos = probe_position(item, cfg.token)
    aggs = downstream_aggregators(item)[::-1]  # rank 0 = the last aggregator before the decision
    span = max(1, item.decision_pos - item.field_span[1])
    for which, ids, label in (("old", item.old_ids, item.correct_old), ("new", item.new_ids, item.correct_new)):
        resid = interp.residual_stream(model, ids)  # [layer, pos, d_model]
        picks = logit_lens_picks(model, resid[:, item.decision_pos], item)
        row = {"item_id": item.item_id, "domain": item.domain, "template_id": item.template_id,
               "prompt": which, "label": label, "label_index": item.outcomes.index(label),
               "model_label_index": item.outcomes.index(picks[-1]),
               "polarity": item.polarity if which == "old" else item.meta.get("polarity_new", item.polarity),
               "probe_pos": pos, "final_pick": picks[-1], "commit_layer": commit_layer(picks),
               "rel_commit": commit_layer(picks) / (len(picks) - 1), "n_aggregators": len(aggs)}
        feats, scale = fp16_scaled(resid[:, aggs].permute(1, 0, 2) if cfg.aggregators and aggs
                                   else resid.new_zeros((0, *resid.shape[::2])))  # [rank, layer, d_model]
        info = [(segment_of(item, p), (p - item.field_span[1]) / span) for p in aggs]
        out.append(Prompt(row, resid[:, pos].cpu().numpy(), feats, info, scale))
    return out


def layer_accuracy(x: np.ndarray, y: np.ndarray, groups: np.ndarray, cfg: LinearConfig) -> list[float]:
    """Grouped cross-validated accuracy at each layer. x: [n, layer, d]; NaN where unmeasurable."""
    ok = cv_correct(x, y, groups, cfg.n_splits, cfg.C)
    return [float("nan")] * x.shape[1] if ok is None else ok.mean(1).tolist()


def _layer_rows(ok: np.ndarray | None, n_layers: int, n: int, extra: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for layer in range(n_layers):
        k = int(ok[layer].sum()) if ok is not None else 0
        acc, lo, hi = wilson_ci(k, n) if ok is not None else (float("nan"),) * 3
        rows.append({**extra, "layer": layer, "rel_layer": layer / max(1, n_layers - 1), "accuracy": acc,
                     "n_correct": k, "n_prompts": n, "ci_lo": lo, "ci_hi": hi})
    return rows


def _labels(rows: Sequence[Mapping[str, Any]], label: str) -> np.ndarray:
    return np.array([r["label_index" if label == "truth" else "model_label_index"] for r in rows])


def aggregator_rows(prompts: Sequence[Prompt], groups: np.ndarray, cfg: LinearConfig) -> list[dict[str, Any]]:
    """Per label, aggregator rank and layer: accuracy with its Wilson CI; and per label and layer
    the mean over ranks with a bootstrap CI over prompts (each prompt's correctness averaged)."""
    n_ranks = min(p.aggs.shape[0] for p in prompts)
    if cfg.max_aggregators is not None:
        n_ranks = min(n_ranks, cfg.max_aggregators)
    if n_ranks == 0:
        return []
    rows = [p.row for p in prompts]
    n, n_layers = len(prompts), prompts[0].feat.shape[0]
    out: list[dict[str, Any]] = []
    for label in cfg.labels:
        y = _labels(rows, label)
        per_rank = []
        for j in range(n_ranks):
            x = np.stack([p.agg(j) for p in prompts])  # [n, layer, d_model]
            ok = cv_correct(x, y, groups, cfg.n_splits, cfg.C)
            segs = [p.agg_info[j][0] for p in prompts]
            where = {"segment": max(set(segs), key=segs.count),
                     "downstream_frac": float(np.mean([p.agg_info[j][1] for p in prompts]))}
            out += _layer_rows(ok, n_layers, n, {"condition": "probe", "label": label, "aggregator": j, **where})
            per_rank.append(ok)
        if all(ok is not None for ok in per_rank):
            mean_ok = np.mean(np.stack([ok for ok in per_rank if ok is not None]), axis=0)  # [layer, n]
            out += [{"condition": "probe_mean", "label": label, "layer": layer,
                     "rel_layer": layer / max(1, n_layers - 1), "n_aggregators": n_ranks,
                     "n_prompts": n, **_acc_ci(mean_ok[layer])} for layer in range(n_layers)]
    return out


def _acc_ci(values: np.ndarray) -> dict[str, Any]:
    c = ci_dict(values)
    return {"accuracy": c["mean"], "ci_lo": c["ci_lo"], "ci_hi": c["ci_hi"]}


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: LinearConfig) -> list[dict[str, Any]]:
    prompts = [p for item in items for p in prompt_rows(model, item, cfg)]
    if not prompts:
        return []
    rows = [p.row for p in prompts]
    groups = np.array([r["template_id"] for r in rows])
    x = np.stack([p.feat for p in prompts])  # [n_prompts, layer, d_model]
    ok = cv_correct(x, _labels(rows, "truth"), groups, cfg.n_splits, cfg.C)
    n_groups = len(set(groups.tolist()))
    out = [{"condition": "prompt", **r} for r in rows]
    out += [r | {"n_groups": n_groups} for r in
            _layer_rows(ok, x.shape[1], len(rows), {"condition": "layer", "label": "truth", "token": cfg.token})]
    if cfg.aggregators:
        out += [r | {"n_groups": n_groups} for r in aggregator_rows(prompts, groups, cfg)]
    return out


def first_written(layers: Sequence[Mapping[str, Any]], threshold: float) -> float:
    hit = [r["rel_layer"] for r in layers if r["accuracy"] >= threshold]
    return float(hit[0]) if hit else float("nan")


def why_unwritten(rows: Sequence[Mapping[str, Any]], prompts: Sequence[Mapping[str, Any]], label: str,
                  threshold: float) -> str | None:
    """Why no layer reaches the threshold (None when one does): the best it came and where."""
    finite = [r for r in rows if np.isfinite(r["accuracy"])]
    if any(r["accuracy"] >= threshold for r in finite):
        return None
    key = "label_index" if label == "truth" else "model_label_index"
    classes = {p[key] for p in prompts}
    if len(classes) < 2:
        pick = prompts[0]["final_pick"] if prompts and label == "model" else "one class"
        return f"{label} labels have a single class ({pick} for every prompt): nothing to separate"
    if not finite:
        return f"accuracy unmeasurable: fewer than two template groups ({label} labels)"
    b = max(finite, key=lambda r: (r["accuracy"], -r["layer"]))
    where = f", aggregator {int(b['aggregator'])} from the last ({b['segment']})" if isinstance(b.get("segment"), str) else ""
    counts = sorted((sum(p[key] == c for p in prompts) for c in classes), reverse=True)
    return (f"{label} labels: accuracy never reaches {threshold:g}; best {b['accuracy']:.2f} "
            f"[{b['ci_lo']:.2f}, {b['ci_hi']:.2f}] at layer {int(b['layer'])} (relative {b['rel_layer']:.2f}){where}, "
            f"n = {int(b['n_prompts'])} prompts, classes {' / '.join(map(str, counts))}")


def summarize_label(records: Sequence[Mapping[str, Any]], prompts: Sequence[Mapping[str, Any]], label: str,
                    threshold: float) -> dict[str, Any]:
    probe = [r for r in records if r.get("condition") == "probe" and r["label"] == label]
    mean = sorted((r for r in records if r.get("condition") == "probe_mean" and r["label"] == label),
                  key=lambda r: r["layer"])
    finite = [r for r in probe if np.isfinite(r["accuracy"])]
    best = max(finite, key=lambda r: (r["accuracy"], -r["layer"])) if finite else None
    curve = sorted((r for r in probe if best is not None and r["aggregator"] == best["aggregator"]),
                   key=lambda r: r["layer"])
    pts = ("layer", "rel_layer", "accuracy", "ci_lo", "ci_hi", "n_prompts")
    return {
        "best_aggregator": None if best is None else {k: best[k] for k in ("aggregator", "segment", "downstream_frac")},
        "accuracy_best": [{k: r[k] for k in pts} for r in curve],
        "accuracy_mean_over_aggregators": [{k: r[k] for k in pts} for r in mean],
        "write_depth_best": first_written(curve, threshold),
        "write_depth_mean": first_written(mean, threshold),
        "max_accuracy": None if best is None else {k: best[k] for k in ("accuracy", "ci_lo", "ci_hi", "layer",
                                                                       "rel_layer", "aggregator", "segment")},
        "why_no_write_depth": why_unwritten(probe, prompts, label, threshold),
    }


def summarize(records: Sequence[Mapping[str, Any]], cfg: LinearConfig) -> dict[str, Any]:
    layers = sorted((r for r in records if r.get("condition") == "layer"), key=lambda r: r["layer"])
    prompts = [r for r in records if r.get("condition") == "prompt"]
    out: dict[str, Any] = {
        "n_prompts": len(prompts),
        "n_items": len({r["item_id"] for r in prompts}),
        "accuracy_by_layer": [r["accuracy"] for r in layers],
        "write_depth": first_written(layers, cfg.threshold),
        "max_accuracy": max((r["accuracy"] for r in layers if np.isfinite(r["accuracy"])), default=float("nan")),
        "write_depth_why": why_unwritten(layers, prompts, "truth", cfg.threshold),
        "commit_depth": ci_dict(r["rel_commit"] for r in prompts),
        "final_pick_correct": proportion(r["final_pick"] == r["label"] for r in prompts),
        "threshold": cfg.threshold,
        "token": cfg.token,
    }
    labels = sorted({str(r["label"]) for r in records if r.get("condition") == "probe"})
    if labels:
        by = {lab: summarize_label(records, prompts, lab, cfg.threshold) for lab in labels}
        out["labels"] = by
        out["reading"] = "; ".join(
            by[lab]["why_no_write_depth"] or f"{lab} labels: write depth {by[lab]['write_depth_best']:.2f} at the best "
            "aggregator" for lab in labels) + f"; the model answers correctly in {out['final_pick_correct']['mean']:.2f} of prompts"
    return out


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "linear"
CONFIG = LinearConfig
HELP = "linear probing of the conclusion (truth and model labels) by layer and aggregator: write and commit depth"
