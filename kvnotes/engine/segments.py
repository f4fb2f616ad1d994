"""Attention over a cache held in segments, each read where it lies: stored blocks are not rotated.

A block prefilled alone holds keys rotated for positions 0..n-1; placed at offset p its tokens sit
at p..p+n-1. RoPE is relative, q(t) . R(p) k(i) = [R(-p) q(t)] . k(i), so instead of rotating the
block's n keys by p (and copying them into a new buffer) the few queries that read the block are
rotated by -p. Attention runs per segment s (the prefix, each block, earlier forwards' tokens, the
forward's own tokens), each giving its output o_s and the log-sum-exp l_s of its visible scores,
and the segments merge exactly: o = sum_s exp(l_s - L) o_s with L = logsumexp_s l_s. The rotation
by -p is pure (`rope_cos_sin` divides YaRN's attention_scaling out, which stays in the query as in
the key it replaces); rope types whose frequencies depend on the sequence (dynamic, longrope) are
refused by `rope_cos_sin`. A key is visible to a query at position t when it sits before t (the
forward's own tokens: at or before t) and, on sliding-window layers, within the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from kvnotes.engine.cache import KVCache, dynamic, slots_class
from kvnotes.engine.rope import rotate_half, rotate_keys
from kvnotes.engine.run import Ids, as_ids, attention_impl, check_positions
from kvnotes.models.loading import LoadedModel
from kvnotes.models.rope_types import check_rope_type

NAME = "kvnotes_segments"


@dataclass(frozen=True)
class Segment:
    """K/V of tokens at `positions` (sorted, CPU) whose keys are rotated for positions - `shift`."""

    keys: tuple[Tensor, ...]  # per layer [1, kv_head, n, d_head]
    values: tuple[Tensor, ...]
    positions: Tensor  # [n] absolute positions
    shift: int = 0  # a block prefilled at 0..n-1 and placed at p: shift = p

    def __post_init__(self) -> None:
        n = int(self.positions.numel())
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("a segment needs the same, non-zero number of key and value layers")
        if any(int(t.shape[2]) != n or int(t.shape[0]) != 1 for t in (*self.keys, *self.values)):
            raise ValueError(f"a segment is batch 1 with {n} positions in every layer")
        if n > 1 and not bool((self.positions[1:] > self.positions[:-1]).all()):
            raise ValueError("a segment's positions must be sorted and distinct")

    @classmethod
    def span(cls, cache: KVCache, start: int, shift: int = 0) -> Segment:
        """`cache` at positions start.., its keys rotated for start - shift.. (a view, no copy)."""
        return cls(cache.keys, cache.values, torch.arange(start, start + cache.seq_len), shift)

    def __len__(self) -> int:
        return int(self.positions.numel())


@dataclass(frozen=True)
class SegmentedCache:
    """A cache as segments that together cover positions 0..end-1 once each."""

    segments: tuple[Segment, ...]

    @property
    def end(self) -> int:
        return max(int(s.positions[-1]) + 1 for s in self.segments if len(s)) if self.segments else 0

    @property
    def n_layers(self) -> int:
        return len(self.segments[0].keys)

    def materialize(self, model: LoadedModel) -> KVCache:
        """The plain cache these segments stand for: every key rotated to its absolute position
        (`rope.rotate_keys`, as `splice` moves a block) in one buffer per layer."""
        n = self.end
        covered = torch.zeros(n, dtype=torch.int64)
        for s in self.segments:
            covered[s.positions] += 1
        if not bool((covered == 1).all()):
            raise ValueError(f"segments do not cover positions 0..{n - 1} once each")
        keys, values = [], []
        for i in range(self.n_layers):
            k0, v0 = self.segments[0].keys[i], self.segments[0].values[i]
            kb = k0.new_empty(1, k0.shape[1], n, k0.shape[3])  # [1, kv_head, n, d_head]
            vb = v0.new_empty(1, v0.shape[1], n, v0.shape[3])
            for s in self.segments:
                at = s.positions.to(kb.device)
                kb[:, :, at] = rotate_keys(model, s.keys[i], s.shift, i).to(kb.device)
                vb[:, :, at] = s.values[i].to(vb.device)
            keys.append(kb)
            values.append(vb)
        return KVCache(tuple(keys), tuple(values))


@dataclass(frozen=True)
class SegmentStep:
    """Logits of the last `logits_to_keep` new positions (fp32) and the cache grown by them."""

    logits: Float[Tensor, "1 keep vocab"] | None
    cache: SegmentedCache


@dataclass
class _Plan:
    """What one forward's attention reads besides its own tokens; memos live for that forward."""

    model: LoadedModel
    cached: tuple[Segment, ...]
    q_pos: Tensor  # [m] positions of the forwarded tokens (CPU)
    windows: list[int | None]  # per layer
    kinds: list[str]  # per layer: its type, which fixes its rotary frequencies
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shifts = sorted({s.shift for s in self.cached if s.shift})  # distinct block offsets
        self.slot = {p: i for i, p in enumerate(self.shifts)}

    def rotation(self, layer: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos/sin [n_shifts, d_head] (fp32) rotating a query by -p for every block offset p: one
        call of the rotary embedding per layer type and forward."""
        key = ("rot", self.kinds[layer])
        if key not in self.memo:
            at = -torch.tensor(self.shifts)
            cos, sin = self.model.adapter.rope_cos_sin(self.model.hf, at, layer)
            self.memo[key] = (cos.to(device), sin.to(device))
        out: tuple[Tensor, Tensor] = self.memo[key]
        return out

    def visible(self, i: int, k_pos: Tensor, window: int | None, g: int, dtype: torch.dtype,
                device: torch.device) -> tuple[bool, Tensor | None]:
        """(whether any query sees segment i, its additive mask [1, 1, g * m, n] for the packed
        query rows, None when every query sees every key). Segment -1 is the forward's own tokens."""
        key = ("mask", i, window, dtype)
        if key not in self.memo:
            q = self.q_pos[:, None]
            ok = (k_pos[None, :] <= q) if i < 0 else (k_pos[None, :] < q)  # [m, n]
            if window is not None:
                ok = ok & (q - k_pos[None, :] < window)
            mask = None
            if not bool(ok.all()):  # rows that see no key get a finite floor: zero weight after the merge
                add = torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, torch.finfo(dtype).min)
                mask = add.repeat(g, 1)[None, None].to(device)  # packed row j * m + t reads row t
            self.memo[key] = (bool(ok.any()), mask)
        out: tuple[bool, Tensor | None] = self.memo[key]
        return out


def _attend(
    q: Float[Tensor, "1 kv rows d"], k: Float[Tensor, "1 kv n d"], v: Float[Tensor, "1 kv n d"],
    mask: Tensor | None, scale: float, softcap: float | None,
) -> tuple[Float[Tensor, "1 kv rows d"], Float[Tensor, "1 kv rows"]]:
    """Softmax attention of packed query rows over one segment, and the rows' log-sum-exp (fp32)."""
    if softcap is None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask, scale=scale)  # fused, no score matrix in memory
        return out.float(), lse.float()
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [1, kv, rows, n]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)  # [1, kv, rows]
    out = torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), v).float()
    return out, lse


def segment_attention(
    module: nn.Module,
    query: Float[Tensor, "1 head m d_head"],
    key: Float[Tensor, "1 kv_head m d_head"],
    value: Float[Tensor, "1 kv_head m d_head"],
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    kvnotes_segments: _Plan | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """An `AttentionInterface` function: the forward's tokens over the cached segments and
    themselves, merged by log-sum-exp (`key`/`value` are the forward's own K/V)."""
    if kvnotes_segments is None:
        raise RuntimeError(f"the {NAME} attention needs kvnotes_segments (kvnotes.engine.segments.extend_segments)")
    plan = kvnotes_segments
    layer = int(getattr(module, "layer_idx"))
    _, h, m, d = query.shape
    kvh = key.shape[1]
    g = h // kvh
    scale = scaling if scaling is not None else d**-0.5
    window = plan.windows[layer]
    dev, dt = query.device, query.dtype
    packed = query.reshape(1, kvh, g * m, d)  # query head h = k * g + j -> rows j * m + t of kv head k
    rotated = None
    if plan.shifts:  # the queries rotated by -p for every block offset p at once: [n_shifts, kv, g * m, d]
        cos, sin = plan.rotation(layer, dev)
        qf = packed.float()
        rotated = (qf * cos[:, None, None] + rotate_half(qf) * sin[:, None, None]).to(dt)
    outs, lses = [], []
    parts = [(i, s.keys[layer], s.values[layer], s.positions, s.shift) for i, s in enumerate(plan.cached)]
    parts.append((-1, key, value, plan.q_pos, 0))
    for i, k, v, k_pos, shift in parts:
        seen, mask = plan.visible(i, k_pos, window, g, dt, dev)
        if not seen:
            continue
        q = packed if not shift else rotated[plan.slot[shift]][None]  # type: ignore[index]
        out, lse = _attend(q, k, v, mask, scale, softcap)
        outs.append(out)
        lses.append(lse)
    weight = torch.softmax(torch.stack(lses), dim=0)  # exp(l_s - logsumexp_s l_s): [parts, 1, kv, g * m]
    out = (torch.stack(outs) * weight[..., None]).sum(0)  # [1, kv, g * m, d]
    out = out.reshape(1, h, m, d).transpose(1, 2).to(dt)  # [1, m, head, d] as attention returns
    return out, None


def register() -> str:
    """Register the segment attention with transformers (idempotent) and return its name. No mask
    function is registered under the name: transformers builds none, visibility is by position."""
    # deferred: transformers is heavy and only this path needs it
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_attention)
    return NAME


@torch.inference_mode()
def extend_segments(
    model: LoadedModel,
    cache: SegmentedCache,
    ids: Ids,
    positions: Sequence[int] | Tensor | None = None,
    logits_to_keep: int | None = 1,
) -> SegmentStep:
    """`ids` forwarded at `positions` (default: appended after the cache) over the segments read
    in place; their K/V become one more segment of the returned cache. Positions below the end
    must be holes no segment covers (a seam being repaired). `logits_to_keep=None`: no LM head."""
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError("extend_segments takes one sequence")
    m, end = int(x.shape[1]), cache.end
    pos = torch.arange(end, end + m) if positions is None else torch.as_tensor(positions, dtype=torch.long).cpu()
    if pos.shape != (m,):
        raise ValueError(f"{m} tokens need {m} positions, got {tuple(pos.shape)}")
    if int(pos.min()) < 0 or (m > 1 and not bool((pos[1:] > pos[:-1]).all())):
        raise IndexError("positions must be sorted, distinct and >= 0")
    taken = torch.cat([s.positions for s in cache.segments]) if cache.segments else pos[:0]
    if bool(torch.isin(pos, taken).any()):
        raise IndexError("positions already held by a segment")
    grown = pos[pos >= end]
    if grown.numel() and not torch.equal(grown, torch.arange(end, end + grown.numel())):
        raise IndexError(f"positions from {end} on must be {end}, {end + 1}, ... (appended)")
    check_positions(model, end, int(grown.numel()))
    hf = model.hf
    if any(s.shift for s in cache.segments):  # before any forward: dynamic, longrope, partial refused
        for i in range(model.n_layers):
            params = model.adapter.rope_parameters(hf, i)
            check_rope_type(str(params.get("rope_type", "default")), i,
                            float(params.get("partial_rotary_factor", 1.0)))
    plan = _Plan(model, cache.segments, pos,
                 [model.adapter.sliding_window(hf, i) for i in range(model.n_layers)],
                 model.adapter.layer_types(hf))
    layers = [slots_class()(None, None, 0, m) for _ in range(model.n_layers)]
    past = dynamic(layers)
    net = hf if logits_to_keep is not None else model.adapter.decoder(hf)
    kw: dict[str, Any] = dict(input_ids=x, past_key_values=past, position_ids=pos.to(model.device)[None],
                              use_cache=True, attention_mask=None, kvnotes_segments=plan)
    if logits_to_keep is not None:
        kw["logits_to_keep"] = m if logits_to_keep == 0 else min(logits_to_keep, m)
    with attention_impl(model, register()):
        out = net(**kw)
    new = Segment(tuple(layer.keys[:, :, :m] for layer in layers),
                  tuple(layer.values[:, :, :m] for layer in layers), pos)
    logits = None if logits_to_keep is None else out.logits.float()
    return SegmentStep(logits, SegmentedCache((*cache.segments, new)))
