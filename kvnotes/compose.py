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


def self_check(
    model: LoadedModel,
    prefix_ids: Ids,
    block_ids: Ids,
    question_ids: Ids,
    seams: list[int] | tuple[int, ...],
) -> list[dict[str, float | int | bool]]:
    """The composition gate: spliced-with-seam-repair vs full recompute, one dict per seam K.

    Reference: a clean prefill of prefix + block + question (last-position logits). Candidate:
    prefix prefilled, block prefilled alone and spliced after it with its first K tokens
    recomputed, then the question run on top. Per K: logit cosine, top-1 agreement and
    KL(full || spliced). Two exactness checks ride along on every row: prefill + extend vs a
    cache-free forward (`max_abs_diff_extend`) and the K = len(block) splice vs the full
    prefill's cache (`max_abs_diff_splice_full`); both should be ~0 up to dtype rounding.
    """
    from kvnotes.metrics import kl_divergence, logit_cosine, top1_agree
    from kvnotes.run import full_logits

    prefix, block, question = (as_ids(model, x) for x in (prefix_ids, block_ids, question_ids))
    bad = [k for k in seams if not 0 <= k <= block.shape[1]]
    if bad:
        raise ValueError(f"seams {bad} outside 0..{block.shape[1]} (the block length)")
    context = torch.cat([prefix, block], dim=1)  # [1, prefix + block]
    full = prefill(model, context)  # the reference cache
    ref = extend(model, full.cache, question).logits[0, -1]  # [vocab]
    forward = full_logits(model, torch.cat([context, question], dim=1))[0, -1]  # [vocab]
    prefix_cache = prefill(model, prefix).cache
    blk = prefill_block(model, block)
    common = {
        "prefix_len": int(prefix.shape[1]),
        "block_len": len(blk),
        "question_len": int(question.shape[1]),
        "max_abs_diff_extend": float((ref - forward).abs().max()),
        "max_abs_diff_splice_full": splice(model, prefix_cache, blk, len(blk)).max_abs_diff(full.cache),
    }
    rows: list[dict[str, float | int | bool]] = []
    for k in seams:
        logits = extend(model, splice(model, prefix_cache, blk, k), question).logits[0, -1]
        rows.append(
            {
                "seam": int(k),
                "cosine": float(logit_cosine(logits, ref)),
                "top1_agree": bool(top1_agree(logits, ref)),
                "kl": float(kl_divergence(ref, logits)),
                **common,
            }
        )
    return rows
