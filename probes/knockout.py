"""Probe `knockout`: does the decision token read the notes? Attention knockout and read heads.

On the new prompt's cache, the decision token's attention to chosen cached keys is removed (-inf
before the softmax) at chosen layers; reversion = (oracle - score) / (oracle - stale) measures
how far the decision falls back to the old value's (1 = fully reverted; `reverted` when > 0.5).
Keys: the top 25 % most-attended downstream positions, the field, an equal-size random downstream
set, the sink; a dose-response over the fraction masked; the top set per layer third. Attention
mass of the decision token is split into field / downstream / sink / other. Read heads: heads
ranked by the decision token's attention to the downstream span have their outputs patched from
the new run into the old one (nnsight), against random heads. Paper: by thirds early 0.00, mid
0.25, late 0.33, all 1.00; mass field/downstream/sink 0.001/0.56/0.36; top-12 heads 0.72-0.82.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from experiments.registry import register
from kvnotes import interp
from kvnotes.metrics import recovery
from kvnotes.models.loading import LoadedModel
from kvnotes.patching import PatchPair, scores_from_logits
from kvnotes.run import read_variants
from kvnotes.tasks.item import TaskItem
from probes._common import (
    ci_dict,
    curve,
    item_fields,
    run_pairs,
    skip_summary,
)
from probes.suffix import bands


@dataclass
class KnockoutConfig:
    margin: float | None = None
    top_fraction: float = 0.25  # the "most-attended" set: this share of downstream positions
    fractions: list[float] = field(default_factory=lambda: [0.05, 0.1, 0.25, 0.5, 0.75, 1.0])
    n_random: int = 3  # random draws for random positions and random heads
    n_sink: int = 1  # the first positions count as the attention sink
    read_heads: bool = True
    n_heads: int = 12
    seed: int = 0
    batch_size: int = 64
    unit_size: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.top_fraction <= 1 or any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError("top_fraction and fractions must be in (0, 1]")
        if self.n_heads < 1 or self.n_sink < 0 or self.n_random < 0:
            raise ValueError("n_heads >= 1, n_sink >= 0, n_random >= 0")


def attention_to_cache(model: LoadedModel, pair: PatchPair) -> torch.Tensor:
    """The decision token's attention weights on the new cache: [layer, head, cached pos]."""
    cap: list[dict[int, torch.Tensor]] = []
    read_variants(model, pair.new, pair.new, [[]], pair.tail, capture=cap)
    w = cap[0]
    return torch.stack([w[layer][0, :, -1, : pair.n_cached] for layer in range(model.n_layers)])


def mass_split(att: torch.Tensor, pair: PatchPair, n_sink: int) -> dict[str, float]:
    """Share of the decision token's attention (mean over layers and heads) on each region."""
    total = att.sum(-1).mean().item()  # the rest goes to the token itself
    def share(pos: list[int]) -> float:
        return float(att[..., pos].sum(-1).mean().item()) if pos else 0.0
    sink = list(range(min(n_sink, pair.item.field_span[0])))
    fld, down = pair.field_positions, pair.downstream_positions
    other = [p for p in range(pair.n_cached) if p not in set(sink + fld + down)]
    return {"mass_field": share(fld), "mass_downstream": share(down), "mass_sink": share(sink),
            "mass_other": share(other), "mass_self": 1.0 - total}


def item_records(model: LoadedModel, pair: PatchPair, cfg: KnockoutConfig, margin: float) -> list[dict[str, Any]]:
    item, down, L = pair.item, pair.downstream_positions, model.n_layers
    rng = random.Random(f"{cfg.seed}/{item.item_id}")
    att = attention_to_cache(model, pair)  # [layer, head, pos]
    base = item_fields(item) | {"margin": margin, "score_stale": pair.score_stale,
                                "score_oracle": pair.score_oracle}
    rows: list[dict[str, Any]] = [base | {"condition": "mass", **mass_split(att, pair, cfg.n_sink)}]
    by_att = [down[i] for i in torch.argsort(att.mean((0, 1))[down], descending=True, stable=True).tolist()]
    n_top = max(1, math.ceil(cfg.top_fraction * len(down)))
    sets: list[tuple[dict[str, Any], list[int], list[int]]] = [
        ({"condition": "top", "n_keys": n_top}, by_att[:n_top], list(range(L))),
        ({"condition": "field", "n_keys": len(pair.field_positions)}, pair.field_positions, list(range(L))),
        ({"condition": "sink", "n_keys": cfg.n_sink}, list(range(cfg.n_sink)), list(range(L))),
    ]
    sets += [({"condition": "random", "n_keys": n_top, "draw": d}, rng.sample(down, n_top), list(range(L)))
             for d in range(cfg.n_random)]
    for f in cfg.fractions:
        k = max(1, math.ceil(f * len(down)))
        sets.append(({"condition": "dose", "fraction": f, "n_keys": k}, by_att[:k], list(range(L))))
    for name, lay in bands(L).items():
        sets.append(({"condition": "band", "band": name, "n_keys": n_top}, by_att[:n_top], lay))
    key_mask = torch.zeros(len(sets), pair.n_cached, dtype=torch.bool)
    layer_mask = torch.zeros(len(sets), L, dtype=torch.bool)
    for i, (_, keys, lay) in enumerate(sets):
        key_mask[i, keys] = True
        layer_mask[i, lay] = True
    logits = read_variants(model, pair.new, pair.new, [[]] * len(sets), pair.tail, key_mask=key_mask,
                           mask_layers=layer_mask, batch_size=cfg.batch_size)[:, -1]
    scores = scores_from_logits(item, logits)
    rev = np.atleast_1d(recovery(scores, pair.score_oracle, pair.score_stale))  # 1 = back to stale
    for (row, _, _), s, r in zip(sets, scores, rev, strict=True):
        rows.append(base | row | {"score": float(s), "reversion": float(r), "reverted": bool(r > 0.5)})
    if cfg.read_heads:
        rows += head_records(model, pair, att, cfg, rng, base)
    return rows


def head_records(model: LoadedModel, pair: PatchPair, att: torch.Tensor, cfg: KnockoutConfig,
                 rng: random.Random, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Patch the outputs of the heads that read the notes (new -> old run) vs random heads."""
    H = att.shape[1]
    notes = att[..., pair.downstream_positions].sum(-1)  # [layer, head]
    order = torch.argsort(notes.flatten(), descending=True).tolist()
    ranked = [(i // H, i % H) for i in order]
    k = min(cfg.n_heads, len(ranked))
    choices = [({"condition": "heads_top", "n_heads": k}, ranked[:k])]
    choices += [({"condition": "heads_random", "n_heads": k, "draw": d}, rng.sample(ranked, k))
                for d in range(cfg.n_random)]
    out = []
    for row, heads in choices:
        logits = interp.patch_head_outputs(model, pair.item.old_ids, pair.item.new_ids, heads)
        s = float(scores_from_logits(pair.item, logits[None])[0])
        r = float(recovery(s, pair.score_stale, pair.score_oracle))
        out.append(base | row | {"heads": str(heads), "score": s, "recovery": r})
    return out


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: KnockoutConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


def _ci(records: Sequence[Mapping[str, Any]], cond: str, key: str) -> dict[str, Any]:
    return ci_dict(float(r[key]) for r in records if r.get("condition") == cond)


def summarize(records: Sequence[Mapping[str, Any]], cfg: KnockoutConfig) -> dict[str, Any]:
    out = skip_summary(records)
    out["mass"] = {k: _ci(records, "mass", k) for k in
                   ("mass_field", "mass_downstream", "mass_sink", "mass_other", "mass_self")}
    for cond in ("top", "field", "sink", "random"):
        out[cond] = {"reversion": _ci(records, cond, "reversion"), "reverted": _ci(records, cond, "reverted")}
    dose = [r | {"recovery": r["reversion"]} for r in records if r.get("condition") == "dose"]
    out["dose"] = curve(dose, "dose", "fraction")  # mean reversion: heavy-tailed, read with dose_reverted
    out["dose_reverted"] = curve([r | {"recovery": float(r["reverted"])} for r in dose], "dose", "fraction")
    band = [r | {"recovery": float(r["reverted"])} for r in records if r.get("condition") == "band"]
    out["bands_reverted"] = curve(band, "band", "band")
    out["heads_top"] = _ci(records, "heads_top", "recovery")
    out["heads_random"] = _ci(records, "heads_random", "recovery")
    return out


register("probe", "knockout", KnockoutConfig, summarize=summarize,
         help="circuit knockout: mask the decision token's attention to the notes; read heads")(run)
