"""The transplant attended in place: stored blocks read where they lie, no key rotated or copied.

`splice.transplant` rotates every block's keys by its landing position p_j into new buffers.
Here each block stays as stored (keys for positions 0..L-1) and becomes a segment with shift p_j:
the queries that read it are rotated by -p_j instead (kvnotes.engine.segments). The first
min(seam, L_j) tokens of every block are left out of its segment and recomputed, with the
question, in one forward at their own positions; they read what `transplant`'s seam repair lets
them read (the prefix, the rest of earlier blocks, the seam tokens before them), so the logits and
the cache (`SegmentedCache.materialize`) equal `transplant_extend`'s to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvnotes.compose.splice import Block, checked_blocks, seam_tokens
from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, as_ids
from kvnotes.engine.segments import Segment, SegmentedCache, SegmentStep, extend_segments
from kvnotes.models.loading import LoadedModel


def segments_of(
    model: LoadedModel, prefix: KVCache | None, blocks: Block | Sequence[Block], seam: int
) -> tuple[SegmentedCache, torch.Tensor, torch.Tensor]:
    """(prefix and every block's unrepaired rest as segments, the seam positions, their ids)."""
    blks = checked_blocks(prefix, blocks, seam)
    segs = [] if prefix is None else [Segment.span(prefix.to(device=model.device), 0)]
    seam_pos, seam_ids = [], []
    at = 0 if prefix is None else prefix.seq_len
    for blk in blks:
        k = seam_tokens(seam, len(blk))
        seam_pos.append(torch.arange(at, at + k))
        seam_ids.append(blk.ids[:, :k])
        if k < len(blk):  # the block as stored (a no-op move when it is on the model's device)
            rest = blk.cache.to(device=model.device).slice(k)
            segs.append(Segment(rest.keys, rest.values, torch.arange(at + k, at + len(blk)), shift=at))
        at += len(blk)
    return SegmentedCache(tuple(segs)), torch.cat(seam_pos), torch.cat(seam_ids, dim=1)


def transplant_extend_inplace(
    model: LoadedModel,
    prefix: KVCache | None,
    blocks: Block | Sequence[Block],
    seam: int,
    ids: Ids | None,
    logits_to_keep: int = 1,
) -> SegmentStep:
    """`splice.transplant_extend` with the blocks attended in place: the seams of every block and
    `ids` (None: the seams only, no LM head) in one forward over the stored blocks."""
    cache, pos, toks = segments_of(model, prefix, blocks, seam)
    end = pos.numel() and int(pos[-1]) + 1
    end = max(end, cache.end)
    if ids is not None:
        x = as_ids(model, ids)
        if x.shape[0] != 1:
            raise ValueError("transplant_extend_inplace takes one sequence")
        pos = torch.cat([pos, torch.arange(end, end + x.shape[1])])
        toks = torch.cat([toks.to(x.device), x], dim=1)
        m = int(x.shape[1])
        keep: int | None = m if logits_to_keep == 0 else min(logits_to_keep, m)
    elif not pos.numel():
        return SegmentStep(None, cache)  # seam 0 and no question: nothing to forward
    else:
        keep = None
    return extend_segments(model, cache, toks, pos, logits_to_keep=keep)
