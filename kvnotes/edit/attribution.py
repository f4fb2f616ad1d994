"""Attribution patching over the KV cache: the whole notes map from one forward and one backward.

Exact patching (kvnotes.edit.patching) puts the oracle's K/V at some cached entries of the stale
cache, runs the last prompt token and reads the decision score S. Attribution estimates that
effect for every entry (position x layer x KV head) at once, to first order, from the gradient
at the stale cache (Nanda's AtP): dS ~ (K_new - K_old) . dS/dK + (V_new - V_old) . dS/dV, keys
post-RoPE as the cache stores them. Keys act through the softmax, where the linear estimate is
poor when a score moves by more than ~1; AtP*'s QK fix (Kramar et al. 2024) recomputes the
readout's attention row exactly with the one patched key (each query head of its KV group, each
tail query) and takes the change in the pattern through dS/dA: dS ~ sum_j (A'_j - A_j) dS/dA_j.
Both are reported. Effects are on the score (patched - stale), the sign of the exact map;
dividing by (oracle - stale) gives its recovery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.edit.patching import PatchPair
from kvnotes.engine.gradients import CacheGradients, cache_gradients
from kvnotes.measure.metrics import recovery
from kvnotes.models.loading import LoadedModel

Map = Float[np.ndarray, "pos layer kv_head"]
METHODS = ("qk", "linear")
PARTS = ("key_linear", "key_qk", "value")  # the stored arrays, in AttributionMap's field order  # key estimate with AtP*'s QK fix (the default), and the plain linear one


@dataclass(frozen=True)
class AttributionMap:
    """Estimated score effect (patched - stale) of patching one cached K or V entry from the new
    run into the old, per [position, layer, kv_head], in float64."""

    key_linear: Map
    key_qk: Map
    value: Map
    score: float  # the score of the clean (stale) forward the gradient was taken at

    def __post_init__(self) -> None:
        if not self.key_linear.shape == self.key_qk.shape == self.value.shape:
            raise ValueError("key and value maps must have the same [pos, layer, kv_head] shape")

    @property
    def shape(self) -> tuple[int, int, int]:
        n, layers, heads = self.value.shape
        return n, layers, heads

    def total(self, method: str = "qk") -> Map:
        """Key plus value effect of each [position, layer, kv_head] entry."""
        if method not in METHODS:
            raise ValueError(f"unknown attribution method {method!r}; valid: {', '.join(METHODS)}")
        return (self.key_qk if method == "qk" else self.key_linear) + self.value

    def per_position(self, method: str = "qk") -> Float[np.ndarray, " pos"]:
        """Estimated effect of patching one position at every layer (the exact map's unit)."""
        return self.total(method).sum(axis=(1, 2))

    def per_position_layer(self, method: str = "qk") -> Float[np.ndarray, "pos layer"]:
        return self.total(method).sum(axis=2)


def qk_fixed_key_effects(
    grads: CacheGradients, layer: int, old_keys: Float[Tensor, "kv_head pos d_head"],
    new_keys: Float[Tensor, "kv_head pos d_head"],
) -> Float[Tensor, "kv_head pos"]:
    """AtP*'s QK fix at `layer`: for each position p and KV head, the tail's attention rows
    recomputed exactly with key p replaced by new_keys[:, p] (the other keys kept), their change
    dotted with dS/dA, summed over the KV head's query heads and the tail queries.

    One score moves by d = s'_p - s_p, so with A the row, D = 1 - A_p + A_p e^d:
    A'_p = A_p e^d / D, A'_j = A_j / D (j != p), and
    dS ~ (A'_p - A_p) u_p + (1/D - 1)(sum_j A_j u_j - A_p u_p), u = dS/dA (fp64, log domain).
    """
    a = grads.probs[layer].double()  # [H, T, N + T]
    u = grads.grad_probs[layer].double()
    s_old = grads.rescore(layer, old_keys).double()  # [H, T, N], the same products as the new ones
    s_new = grads.rescore(layer, new_keys).double()
    n = s_old.shape[-1]
    hidden = torch.isinf(s_old)
    d = torch.where(hidden, torch.zeros_like(s_old), s_new - s_old)  # hidden keys stay hidden
    ap, up = a[..., :n], u[..., :n]  # [H, T, N]
    whole = (a * u).sum(-1, keepdim=True)  # [H, T, 1] sum_j A_j u_j over cache and tail
    log_ap = torch.log(ap)  # -inf where A_p = 0: then nothing moves
    log_d = torch.logaddexp(torch.log1p(-ap.clamp(max=1.0)), log_ap + d)
    ap_new = torch.exp(log_ap + d - log_d)
    inv_d = torch.exp(-log_d)
    eff = (ap_new - ap) * up + (inv_d - 1.0) * (whole - ap * up)  # [H, T, N]
    eff = torch.where((ap > 0) & (d != 0), eff, torch.zeros_like(eff))  # an unchanged key: exactly 0
    kv = new_keys.shape[0]
    return eff.reshape(kv, -1, n).sum(1)  # [H, T, N] -> [KV, g*T, N] -> [KV, N]


def attribute_cache(
    model: LoadedModel, pair: PatchPair, grads: CacheGradients | None = None
) -> AttributionMap:
    """The attribution map of one item: one forward and one backward over the stale cache (or the
    `grads` given, for a one-term metric), then per layer a few tensor products with the
    new-minus-old K/V. A metric of several terms (answers of several tokens) is the sum of each
    term's map, each from its own teacher-forced tail."""
    terms = pair.metric.terms
    if grads is not None or len(terms) == 1:
        term = terms[0]
        if grads is None:
            tail = torch.tensor([term.tail(int(pair.tail[0, -1]))])
            grads = cache_gradients(model, pair.old, tail, lambda logits: term.fn(term.select(logits[None]))[0])
        return _map(pair, grads)
    maps = [attribute_cache(model, replace(pair, metric=replace(pair.metric, terms=(t,)))) for t in terms]
    key_linear, key_qk, value = (np.sum([getattr(m, name) for m in maps], axis=0) for name in PARTS)
    return AttributionMap(key_linear, key_qk, value, score=float(sum(m.score for m in maps)))


def _map(pair: PatchPair, grads: CacheGradients) -> AttributionMap:
    kl, kq, vv = [], [], []
    for layer in range(pair.old.n_layers):
        dev = grads.grad_keys[layer].device
        k_old, k_new = pair.old.keys[layer][0].to(dev).float(), pair.new.keys[layer][0].to(dev).float()
        v_old, v_new = pair.old.values[layer][0].to(dev).float(), pair.new.values[layer][0].to(dev).float()
        kl.append(((k_new - k_old) * grads.grad_keys[layer]).sum(-1))  # [KV, N]
        vv.append(((v_new - v_old) * grads.grad_values[layer]).sum(-1))
        kq.append(qk_fixed_key_effects(grads, layer, k_old, k_new))

    def stack(xs: list[Tensor]) -> Map:
        return torch.stack(xs).permute(2, 0, 1).double().cpu().numpy()  # [L, KV, N] -> [N, L, KV]

    return AttributionMap(stack(kl), stack(kq), stack(vv), grads.score)


def to_recovery(pair: PatchPair, effects: np.ndarray, min_denominator: float = 1e-4) -> np.ndarray:
    """Effects on the score as recoveries, the exact map's unit: effect / (oracle - stale)."""
    out = recovery(pair.score_stale + np.asarray(effects, dtype=np.float64), pair.score_stale,
                   pair.score_oracle, min_denominator)
    return np.asarray(out, dtype=np.float64)


def encode(a: AttributionMap) -> dict[str, object]:
    """The map as a compact record: float16 bytes of each [pos, layer, kv_head] array and its shape
    (a float16 keeps ~3 significant digits, enough to rank and to draw)."""
    return {"map_shape": list(a.shape), "score_clean": a.score,
            **{f"map_{name}": getattr(a, name).astype(np.float16).tobytes() for name in PARTS}}


def decode(record: Mapping[str, Any]) -> AttributionMap:
    """The map of a record written by `encode` (float64 arrays of the stored float16 values)."""
    shape = tuple(int(x) for x in record["map_shape"])
    parts = [np.frombuffer(record[f"map_{name}"], dtype=np.float16).astype(np.float64).reshape(shape)
             for name in PARTS]
    key_linear, key_qk, value = parts
    return AttributionMap(key_linear, key_qk, value, score=float(record["score_clean"]))


def top_positions(values: np.ndarray, k: int, candidates: list[int] | None = None) -> list[int]:
    """The k positions (among `candidates`, default all) of largest value, best first; ties by
    position (stable)."""
    cand = list(range(len(values))) if candidates is None else list(candidates)
    order = sorted(cand, key=lambda p: (-float(values[p]), p))
    return order[:k]
