"""Precompiled blocks: prefill alone, reposition by one RoPE rotation, splice, repair the seam.

A block prefilled alone holds keys rotated for positions 0..L-1. Placed after a prefix of length
p, its keys need positions p..p+L-1: one rotation by delta = p. Values carry no position and are
copied. What the block's tokens never saw is the prefix; seam repair recomputes its first K
tokens against the real prefix, which heals most of that loss (K = L is a full recompute).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine.cache import KVCache, buffers, cat
from kvnotes.engine.rope import reposition
from kvnotes.engine.run import (
    Ids,
    Step,
    as_ids,
    extend,
    extend_into,
    forward_at,
    full_logits,
    prefill,
)
from kvnotes.measure.metrics import kl_divergence, logit_cosine, top1_agree
from kvnotes.models.loading import LoadedModel


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


def seam_tokens(seam: int, length: int) -> int:
    """How many of a block's `length` tokens a seam of `seam` recomputes: min(seam, length).

    The one seam rule of `splice` and `transplant`: a seam is an int >= 0, and one at least as
    long as a block recomputes all of it (exact), so one seam serves blocks of any lengths.
    """
    try:
        k = operator.index(seam)  # an int, numpy's included; not 2.5 or "4"
    except TypeError:
        raise ValueError(f"seam must be an int >= 0, got {seam!r}") from None
    if k < 0 or isinstance(seam, bool):
        raise ValueError(f"seam must be an int >= 0, got {seam!r}")
    return min(k, length)


def splice(model: LoadedModel, prefix: KVCache | None, block: Block, seam: int = 0) -> KVCache:
    """prefix + block, the block's keys rotated to follow the prefix; its first `seam` tokens
    recomputed (all of them when seam >= its length: `seam_tokens`)."""
    k = seam_tokens(seam, len(block))
    at = 0 if prefix is None else prefix.seq_len
    moved = reposition(model, block.cache.to(device=model.device), at)
    if k == 0:
        return moved if prefix is None else cat([prefix, moved])
    repaired = extend(model, prefix, block.ids[:, :k]).cache  # prefix + first k tokens
    if k == len(block):
        return repaired
    return cat([repaired, moved.slice(k)])


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


# --- the transplant fast path -----------------------------------------------------------------
# `splice` is the reference (one rotation, then a concatenation and a seam forward per block).
# `transplant` computes the same cache with one preallocated buffer per layer: every key is
# rotated straight into its final slot (fp32 math, then one cast), values and the prefix are
# copied once, and the seams of all blocks are repaired together in one forward at arbitrary
# positions (run.forward_at), whose masks give each seam token exactly what its sequential
# repair sees. `transplant_extend` also runs the question in that forward: what TTFT times.


def _rotate_into(
    out: Float[Tensor, "batch kv_head pos d_head"],
    keys: Float[Tensor, "batch kv_head pos d_head"],
    cos: Float[Tensor, " d_head"],
    sin: Float[Tensor, " d_head"],
) -> None:
    """out <- keys * cos + rotate_half(keys) * sin, bit-identical to `rope.rotate_keys`.

    rotate_half(k) = [-k2, k1], so the first half is k1 cos1 - k2 sin1 and the second
    k2 cos2 + k1 sin2; subtracting the product equals adding its negation exactly in IEEE.
    """
    if cos.shape[-1] != keys.shape[-1]:
        raise ValueError(f"rotary dim {cos.shape[-1]} != key dim {keys.shape[-1]}; "
                         "partial rotary is not supported")
    k = keys.to(device=out.device, dtype=torch.float32)  # no copy for fp32 keys on this device
    h = k.shape[-1] // 2
    dst = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
    torch.mul(k, cos, out=dst)  # [batch, kv_head, pos, d_head]
    dst[..., :h] -= k[..., h:] * sin[:h]
    dst[..., h:] += k[..., :h] * sin[h:]
    if dst is not out:
        out.copy_(dst)  # one rounding to the cache dtype, as rotate_keys' .to(dtype)


@dataclass(frozen=True)
class _Assembled:
    """prefix + rotated blocks in buffers with scratch room; the seam slots and their tokens."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    total: int
    seam_pos: Tensor  # [n_seam] positions to recompute
    seam_ids: Tensor  # [1, n_seam]


def checked_blocks(prefix: KVCache | None, blocks: Block | Sequence[Block], seam: int) -> list[Block]:
    """The blocks of a transplant as a list, refused in one line when there are none, the seam is
    negative, the dtypes differ or a cache is not batch 1 (the rotated and the in-place paths alike)."""
    blks = [blocks] if isinstance(blocks, Block) else list(blocks)
    if not blks:
        raise ValueError("nothing to transplant")
    seam_tokens(seam, 0)  # the seam rule, before any block is read
    dtype = blks[0].cache.dtype
    bad = [b.cache.dtype for b in blks if b.cache.dtype != dtype]
    if prefix is not None and prefix.dtype != dtype:
        bad.append(prefix.dtype)
    if bad:
        raise ValueError(f"blocks and prefix must share one dtype, got {dtype} and {bad}")
    if any(b.cache.batch != 1 for b in blks) or (prefix is not None and prefix.batch != 1):
        raise ValueError("transplant builds batch-1 caches")
    return blks


def _assemble(
    model: LoadedModel, prefix: KVCache | None, blocks: Block | Sequence[Block], seam: int, extra: int
) -> _Assembled:
    """Every block's keys rotated by its landing position p_j into one buffer per layer, after
    the prefix; seam tokens included (finite until the repair replaces them); `extra` more slots."""
    blks = checked_blocks(prefix, blocks, seam)
    first = blks[0].cache
    dtype, dev = first.dtype, model.device
    start = 0 if prefix is None else prefix.seq_len
    total = start + sum(len(b) for b in blks)
    seams, seam_ids, pos = [], [], start
    for blk in blks:  # the seam slots of every block, in order
        k = seam_tokens(seam, len(blk))
        seams.append(torch.arange(pos, pos + k))
        seam_ids.append(blk.ids[:, :k])
        pos += len(blk)
    room = total + sum(int(s.numel()) for s in seams) + extra  # scratch for the forward after
    keys = tuple(torch.empty(1, k.shape[1], room, k.shape[3], dtype=dtype, device=dev)
                 for k in first.keys)  # per layer [1, kv_head, room, d_head]
    values = tuple(torch.empty(1, v.shape[1], room, v.shape[3], dtype=dtype, device=dev)
                   for v in first.values)
    if prefix is not None:
        for i in range(first.n_layers):
            keys[i][:, :, :start].copy_(prefix.keys[i])
            values[i][:, :, :start].copy_(prefix.values[i])
    lands = torch.tensor([start] + [len(b) for b in blks[:-1]]).cumsum(0)  # p_j of every block
    at = lands.to(dev)  # once: a host-to-device copy per layer would wait for the GPU each time
    for i in range(first.n_layers):
        cos, sin = model.adapter.rope_cos_sin(model.hf, at, i)  # [n_blocks, d_head] fp32, on dev
        for j, blk in enumerate(blks):
            lo = int(lands[j])
            _rotate_into(keys[i][:, :, lo : lo + len(blk)], blk.cache.keys[i], cos[j], sin[j])
            values[i][:, :, lo : lo + len(blk)].copy_(blk.cache.values[i])
    return _Assembled(keys, values, total, torch.cat(seams), torch.cat(seam_ids, dim=1))


def _view(a: _Assembled, stop: int) -> KVCache:
    return KVCache(tuple(k[:, :, :stop] for k in a.keys), tuple(v[:, :, :stop] for v in a.values))


def transplant(
    model: LoadedModel,
    prefix: KVCache | None,
    blocks: Block | Sequence[Block],
    seam: int = 0,
) -> KVCache:
    """prefix + blocks, equal to `splice_many(model, prefix, blocks, seam)` (to fp32 rounding).

    Block j lands at p_j = |prefix| + sum of earlier block lengths; its keys are rotated by
    delta = p_j into the output buffer, then the first min(seam, L_j) tokens of every block are
    recomputed in ONE forward: seam token s reads every earlier position that is not a seam
    (prefix, the rotated rest of earlier blocks) and the seam tokens before it, which is what
    block-by-block repair gives it. With seam = 0 the result is bit-identical to `splice_many`.
    Stored blocks may be memory-mapped on CPU: they are read once, while rotating.
    """
    a = _assemble(model, prefix, blocks, seam, 0)
    if a.seam_pos.numel():
        forward_at(model, a.keys, a.values, a.total, a.seam_ids, a.seam_pos)
    return _view(a, a.total)


def transplant_extend(
    model: LoadedModel,
    prefix: KVCache | None,
    blocks: Block | Sequence[Block],
    seam: int,
    ids: Ids,
    logits_to_keep: int = 1,
) -> Step:
    """`extend(transplant(prefix, blocks, seam), ids)` with the seam repair and `ids` in ONE forward.

    The tokens of `ids` read the repaired seams of the same forward (a layer's K/V of every
    token exist before that layer's attention), so the result equals the two calls to fp32
    rounding, and the weights are read once: the time to first token of a composed prompt.
    """
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError("transplant_extend takes one sequence")
    m = x.shape[1]
    a = _assemble(model, prefix, blocks, seam, m)
    pos = torch.cat([a.seam_pos, torch.arange(a.total, a.total + m)])
    toks = torch.cat([a.seam_ids.to(x.device), x], dim=1)
    keep = m if logits_to_keep == 0 else min(logits_to_keep, m)  # 0: every position of `ids`
    logits = forward_at(model, a.keys, a.values, a.total, toks, pos, logits_to_keep=keep)
    assert logits is not None
    return Step(logits, _view(a, a.total + m))


def greedy(
    model: LoadedModel,
    cache: KVCache | None,
    ids: Ids,
    max_new_tokens: int = 16,
    stop_ids: Sequence[int] = (),
) -> tuple[list[int], Float[Tensor, " vocab"]]:
    """Greedy continuation of `ids` after `cache`, stopping at `stop_ids`.

    Returns the new tokens and the first next-token logits (fp32), the ones TTFT is about. The
    cache is copied once into buffers with room for `ids` and every new token; each step then
    writes into them (`run.extend_into`), so a long context is not copied per token.
    """
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError("greedy continues one sequence")
    room = x.shape[1] + max(max_new_tokens - 1, 0)  # the last new token is never forwarded
    if cache is None:
        step = extend(model, None, x)
        keys, values = buffers(step.cache, room - x.shape[1], 1, model.device)
    else:
        keys, values = buffers(cache, room, 1, model.device)
        step = extend_into(model, keys, values, cache.seq_len, x)
    first = step.logits[0, -1]
    out: list[int] = []
    stops = set(stop_ids)
    for _ in range(max_new_tokens):
        tok = int(step.logits[0, -1].argmax())
        if tok in stops:
            break
        out.append(tok)
        if len(out) < max_new_tokens:
            step = extend_into(model, keys, values, step.cache.seq_len, [tok])
    return out, first
