"""Precompiled blocks: prefill alone, reposition by one RoPE rotation, splice, repair the seam.

A block prefilled alone holds keys rotated for positions 0..L-1. Placed after a prefix of length
p, its keys need positions p..p+L-1: one rotation by delta = p. Values carry no position and are
copied. What the block's tokens never saw is the prefix; seam repair recomputes its first K
tokens against the real prefix, which heals most of that loss (K = L is a full recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from kvnotes.cache import KVCache, cat
from kvnotes.models.loading import LoadedModel
from kvnotes.rope import reposition
from kvnotes.run import Ids, as_ids, extend, prefill


@dataclass(frozen=True)
class Block:
    """Token ids of a block and its K/V prefilled alone at positions 0..L-1."""

    ids: Int[Tensor, "1 pos"]
    cache: KVCache

    def __len__(self) -> int:
        return int(self.ids.shape[1])


def prefill_block(model: LoadedModel, ids: Ids) -> Block:
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError("a block is a single sequence")
    return Block(x.cpu(), prefill(model, x).cache)


def splice(model: LoadedModel, prefix: KVCache | None, block: Block, seam: int = 0) -> KVCache:
    """prefix + block, the block's keys rotated to follow the prefix; first `seam` tokens recomputed."""
    if not 0 <= seam <= len(block):
        raise ValueError(f"seam must be in 0..{len(block)}, got {seam}")
    at = 0 if prefix is None else prefix.seq_len
    moved = reposition(model, block.cache.to(device=model.device), at)
    if seam == 0:
        return moved if prefix is None else cat([prefix, moved])
    repaired = extend(model, prefix, block.ids[:, :seam]).cache  # prefix + first `seam` tokens
    if seam == len(block):
        return repaired
    return cat([repaired, moved.slice(seam)])


def splice_many(
    model: LoadedModel, prefix: KVCache | None, blocks: list[Block], seam: int = 0
) -> KVCache:
    """Several blocks one after another, each repositioned to where it lands."""
    out = prefix
    for block in blocks:
        out = splice(model, out, block, seam)
    if out is None:
        raise ValueError("nothing to splice")
    return out


def block_ids(blocks: list[Block]) -> Tensor:
    return torch.cat([b.ids for b in blocks], dim=1)
