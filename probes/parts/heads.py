"""Read heads of probe `knockout`: recovery when k heads at the decision token output what they
output in the new run, the rest of the old run unchanged, over k = 1, 2, 4, ..., 64.

Heads are ranked two ways: by the decision token's attention to the notes (the downstream span,
summed over positions; what the paper ranks by) and by each head's own patching effect (its
recovery alone, measured on the same item: an in-sample upper bound on what a ranking can do);
random head sets of the same k are the control. If the attention ranking lags the effect ranking,
the gap to the paper's 0.72-0.82 at k = 12 is a ranking question; if both stay low, it is the
protocol (what is patched and where), not which heads are chosen.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvnotes.edit.patching import PatchPair, head_scores, recoveries
from kvnotes.engine import interp
from kvnotes.measure.metrics import ci_dict
from kvnotes.models.loading import LoadedModel
from probes.parts.readouts import per_item

RANKINGS = ("attention", "effect")


def _masks(sets: Sequence[Sequence[tuple[int, int]]], n_layers: int, n_heads: int) -> torch.Tensor:
    m = torch.zeros(len(sets), n_layers, n_heads, dtype=torch.bool)  # [set, layer, head]
    for i, heads in enumerate(sets):
        for layer, head in heads:
            m[i, layer, head] = True
    return m


def head_records(
    model: LoadedModel,
    pair: PatchPair,
    att: torch.Tensor,
    ks: Sequence[int],
    rankings: Sequence[str],
    n_random: int,
    rng: random.Random,
    base: Mapping[str, Any],
    batch_size: int = 64,
    given: Mapping[str, list[tuple[int, int]]] | None = None,
) -> list[dict[str, Any]]:
    """Per-head effects and the k-head curves of one item. att: [layer, head, cached pos].

    `given`: head orders the caller ranked (experiment `heads_heldout`: by effect on other items);
    an "effect" order given is used as is, without measuring the single-head effects again.
    """
    L, H = int(att.shape[0]), int(att.shape[1])
    z_new = interp.tail_head_outputs(model, pair.new, pair.tail)  # [layer, head, d_head]
    every = all_heads(L, H)
    notes = notes_attention(pair, att)  # [layer, head]
    rows: list[dict[str, Any]] = []
    order: dict[str, list[tuple[int, int]]] = dict(given or {})
    order["attention"] = [every[i] for i in torch.argsort(notes.flatten(), descending=True, stable=True).tolist()]
    if "effect" in rankings and "effect" not in order:
        single = _recover(model, pair, z_new, [[h] for h in every], batch_size)
        order["effect"] = rank_heads(single, every)
        rows += [dict(base) | {"condition": "head_single", "layer": layer, "head": head,
                               "attention_to_notes": float(notes[layer, head]), "recovery": float(r)}
                 for (layer, head), r in zip(every, single, strict=True)]
    sets: list[tuple[dict[str, Any], list[tuple[int, int]]]] = []
    for k in sorted({k for k in ks if k <= len(every)}):
        sets += [({"condition": "heads", "ranking": rk, "n_heads": k}, order[rk][:k]) for rk in rankings]
        sets += [({"condition": "heads", "ranking": "random", "n_heads": k, "draw": d}, rng.sample(every, k))
                 for d in range(n_random)]
    rec = _recover(model, pair, z_new, [s for _, s in sets], batch_size)
    rows += [dict(base) | row | {"heads": str(sorted(s)), "recovery": float(r)}
             for (row, s), r in zip(sets, rec, strict=True)]
    return rows


def notes_attention(pair: PatchPair, att: torch.Tensor) -> torch.Tensor:
    """The decision token's attention to the notes, att [layer, head, cached pos] summed over the
    downstream span: [layer, head], what the attention ranking orders heads by."""
    return att[..., pair.downstream_positions].sum(-1)


def all_heads(n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """Every (layer, head), layer-major: the order of single-head effect arrays."""
    return [(layer, head) for layer in range(n_layers) for head in range(n_heads)]


def rank_heads(effects: np.ndarray, every: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Heads by effect, largest first (NaN last; ties keep layer-major order)."""
    key = np.nan_to_num(np.asarray(effects, dtype=float), nan=-np.inf)
    return [every[i] for i in np.argsort(-key, kind="stable")]


def single_effects(model: LoadedModel, pair: PatchPair, batch_size: int = 64) -> np.ndarray:
    """Each head's own recovery on one item (layer-major, as `all_heads`)."""
    z_new = interp.tail_head_outputs(model, pair.new, pair.tail)
    return _recover(model, pair, z_new, [[h] for h in all_heads(int(z_new.shape[0]), int(z_new.shape[1]))],
                    batch_size)


def _recover(model: LoadedModel, pair: PatchPair, z_new: torch.Tensor,
             sets: Sequence[Sequence[tuple[int, int]]], batch_size: int) -> np.ndarray:
    L, H = int(z_new.shape[0]), int(z_new.shape[1])
    if not sets:
        return np.zeros(0)
    return recoveries(pair, head_scores(model, pair, z_new, _masks(sets, L, H), batch_size))



def _at(rows: Sequence[Mapping[str, Any]], ranking: str, k: int) -> dict[str, float]:
    """item -> recovery of the k-head set of one ranking (random draws averaged per item)."""
    return per_item(rows, lambda r: r["ranking"] == ranking and int(r["n_heads"]) == k, "recovery")


def summarize_heads(records: Sequence[Mapping[str, Any]], paper_k: int) -> dict[str, Any]:
    """Curves of recovery over k per ranking (random: draws averaged per item), and k = paper_k."""
    rows = [r for r in records if r.get("condition") == "heads"]
    out: dict[str, Any] = {}
    for rk in sorted({str(r["ranking"]) for r in rows}):
        ks = sorted({int(r["n_heads"]) for r in rows if r["ranking"] == rk})
        out[rk] = [{"n_heads": k, **ci_dict(_at(rows, rk, k).values())} for k in ks]
    at = {rk: next((p for p in curve if p["n_heads"] == paper_k), None) for rk, curve in out.items()}
    single = [r for r in records if r.get("condition") == "head_single"]
    best = per_item(single, lambda r: True, "recovery") if single else {}
    return {"curves": out, f"at_k{paper_k}": at,
            "best_single_head_mean": ci_dict(
                max(float(r["recovery"]) for r in single if r["item_id"] == i) for i in best)}
