"""Positions ranked by what the decision token attends to, and random sets matched to a ranking.

The decision token's attention weights on the cache ([layer, head, position], read once on the
new cache) order candidate positions by their mean over the chosen layers and query heads (all
by default): the "most-attended" sets of the probes, the scrub and the pair API. A control for a
chosen set is a random set of the same size whose distances to the decision token match it:
each chosen key gets a partner among the few free positions nearest to it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine.variants import read_variants
from kvnotes.models.loading import LoadedModel


def decision_attention(model: LoadedModel, pair: object) -> Float[Tensor, "layer head pos"]:
    """The decision token's attention weights on a PatchPair's new cache: [layer, head, cached pos]."""
    new, tail = pair.new, pair.tail  # type: ignore[attr-defined]
    cap: list[dict[int, Tensor]] = []
    read_variants(model, new, new, [[]], tail, capture=cap)
    w = cap[0]
    return torch.stack([w[layer][0, :, -1, : new.seq_len] for layer in range(model.n_layers)])


def rank_by_attention(att: Float[Tensor, "layer head pos"], candidates: Sequence[int],
                      layers: Sequence[int] | None = None, heads: Sequence[int] | None = None) -> list[int]:
    """`candidates` by the decision token's attention, mean over `layers` and query `heads` (None:
    all), most attended first; ties keep the candidates' order."""
    a = att if layers is None else att[list(layers)]
    a = a if heads is None else a[:, list(heads)]
    cand = list(candidates)
    order = torch.argsort(a.mean((0, 1))[cand], descending=True, stable=True).tolist()
    return [cand[i] for i in order]


def top_attended(att: Float[Tensor, "layer head pos"], candidates: Sequence[int], fraction: float,
                 layers: Sequence[int] | None = None, heads: Sequence[int] | None = None) -> list[int]:
    """The `fraction` of `candidates` attended most (at least one), sorted by position."""
    n = max(1, math.ceil(fraction * len(candidates)))
    return sorted(rank_by_attention(att, candidates, layers, heads)[:n])


def matched_random(top: Sequence[int], pool: Sequence[int], anchor: int, rng: random.Random,
                   width: int) -> list[int]:
    """A random set like `top` in count and in distance from `anchor`, drawn from `pool` - top:
    each top key (in random order) gets a partner drawn among the `width` unused positions whose
    distance to the anchor is nearest to its own."""
    free = sorted(set(pool) - set(top))
    if len(free) < len(top):
        raise ValueError(f"{len(top)} keys to match from {len(free)} free positions")
    out = []
    for p in rng.sample(list(top), len(top)):
        near = sorted(free, key=lambda q: (abs(q - p), q))[:width]  # |d_q - d_p| = |q - p|
        q = rng.choice(near)
        free.remove(q)
        out.append(q)
    return sorted(out)
