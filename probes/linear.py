"""Probe `linear`: at which depth is the conclusion written into the notes, and when is it read?

On the 2x2 polarity items (field value x rule polarity), the label of a prompt is its
*conclusion* (the correct outcome), which is independent of the field value. A logistic
regression reads the label from the residual stream (after each layer) at a downstream
aggregator token, cross-validated with folds grouped by template so phrasings never leak.
write depth = first relative layer whose accuracy >= `threshold` (paper 0.19-0.39); commit depth
= first relative layer from which the logit lens at the decision token (final norm + unembed of
the residual) picks the model's final answer among the outcomes and keeps it (paper 0.47-0.75).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from experiments.registry import register
from kvnotes import interp
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes._common import ci_dict


@dataclass
class LinearConfig:
    token: str = "last_aggregator"  # last_aggregator | first_aggregator | decision
    threshold: float = 0.9  # accuracy that counts as "written"
    n_splits: int = 5  # grouped CV folds (fewer when there are fewer templates)
    C: float = 1.0  # inverse L2 strength of the logistic regression
    unit_size: int = 0  # cross-validation needs every item: one unit

    def __post_init__(self) -> None:
        if self.token not in ("last_aggregator", "first_aggregator", "decision"):
            raise ValueError(f"token={self.token!r}; valid: last_aggregator, first_aggregator, decision")
        if not 0 < self.threshold <= 1 or self.n_splits < 2:
            raise ValueError("threshold in (0, 1] and n_splits >= 2")


Which = Literal["old", "new"]


def probe_position(item: TaskItem, token: str) -> int:
    """The residual position read for the label: an aggregator after the field, or the decision."""
    after = [p for p in item.aggregators if p >= item.field_span[1] and p < item.decision_pos]
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


def prompt_rows(model: LoadedModel, item: TaskItem, cfg: LinearConfig) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    rows, feats = [], []
    pos = probe_position(item, cfg.token)
    for which, ids, label in (("old", item.old_ids, item.correct_old), ("new", item.new_ids, item.correct_new)):
        resid = interp.residual_stream(model, ids)  # [layer, pos, d_model]
        picks = logit_lens_picks(model, resid[:, item.decision_pos], item)
        feats.append(resid[:, pos].cpu().numpy())  # [layer, d_model]
        rows.append({"item_id": item.item_id, "domain": item.domain, "template_id": item.template_id,
                     "prompt": which, "label": label, "label_index": item.outcomes.index(label),
                     "polarity": item.polarity if which == "old" else item.meta.get("polarity_new", item.polarity),
                     "probe_pos": pos, "final_pick": picks[-1], "commit_layer": commit_layer(picks),
                     "rel_commit": commit_layer(picks) / (len(picks) - 1)})
    return rows, feats


def layer_accuracy(x: np.ndarray, y: np.ndarray, groups: np.ndarray, cfg: LinearConfig) -> list[float]:
    """Grouped cross-validated accuracy of a logistic regression at each layer. x: [n, layer, d]."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n_groups = len(set(groups.tolist()))
    if n_groups < 2 or len(set(y.tolist())) < 2:
        return [float("nan")] * x.shape[1]
    cv = GroupKFold(n_splits=min(cfg.n_splits, n_groups))
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=cfg.C, max_iter=2000))
    return [float(cross_val_score(clf, x[:, layer], y, groups=groups, cv=cv).mean())
            for layer in range(x.shape[1])]


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: LinearConfig) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    feats: list[np.ndarray] = []
    for item in items:
        r, f = prompt_rows(model, item, cfg)
        rows += r
        feats += f
    if not rows:
        return []
    x = np.stack(feats)  # [n_prompts, layer, d_model]
    y = np.array([r["label_index"] for r in rows])
    groups = np.array([r["template_id"] for r in rows])
    acc = layer_accuracy(x, y, groups, cfg)
    n_layers = x.shape[1]
    out = [{"condition": "prompt", **r} for r in rows]
    out += [{"condition": "layer", "layer": i, "rel_layer": i / (n_layers - 1), "accuracy": a,
             "n_prompts": len(rows), "n_groups": len(set(groups.tolist()))} for i, a in enumerate(acc)]
    return out


def summarize(records: Sequence[Mapping[str, Any]], cfg: LinearConfig) -> dict[str, Any]:
    layers = sorted((r for r in records if r.get("condition") == "layer"), key=lambda r: r["layer"])
    prompts = [r for r in records if r.get("condition") == "prompt"]
    written = [r["rel_layer"] for r in layers if r["accuracy"] >= cfg.threshold]
    return {
        "n_prompts": len(prompts),
        "n_items": len({r["item_id"] for r in prompts}),
        "accuracy_by_layer": [r["accuracy"] for r in layers],
        "write_depth": written[0] if written else float("nan"),
        "max_accuracy": max((r["accuracy"] for r in layers), default=float("nan")),
        "commit_depth": ci_dict(r["rel_commit"] for r in prompts),
        "final_pick_correct": ci_dict(float(r["final_pick"] == r["label"]) for r in prompts),
        "threshold": cfg.threshold,
        "token": cfg.token,
    }


register("probe", "linear", LinearConfig, summarize=summarize,
         help="linear probing of the conclusion by layer: write depth and commit depth")(run)
