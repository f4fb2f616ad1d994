"""Attention of a few tail tokens over a shared cache with per-variant position patches.

The per-position patching map asks the same question N times: what does the decision token read
if the cached K/V at position p (all or some layers) came from the other run? Materialising N
patched caches costs N cache copies. Here the tail's attention is computed once against the
shared base cache, broadcast over a batch of variants, and each variant's few patched columns are
replaced: scores[b, :, :, P_b] = q_b . k_src[P_b] and the output gains
sum_p w[b, p] (v_src[p] - v_base[p]). That is exact (same softmax, same values), and costs a
batch of single-token attentions over N keys instead of N cache copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from kvnotes.cache import KVCache

NAME = "kvnotes_variants"


@dataclass(frozen=True)
class Variants:
    """B variants of `base`: variant b takes K/V at positions[b] (padded with -1) from `src`.

    `layers[b, l]` says whether variant b patches layer l. The tail tokens sit right after the
    base cache. Knockout: `key_mask[b, n]` removes cached key n from variant b's attention (-inf
    before the softmax) at the layers of `mask_layers[b]` and the query heads of `mask_heads[b]`
    (None: all). `capture`, when given, receives each layer's attention weights of the tail,
    [batch, head, tail, pos + tail], under key `layer`.
    """

    base: KVCache
    src: KVCache
    positions: Int[Tensor, "batch m"]
    layers: Bool[Tensor, "batch layer"]
    key_mask: Bool[Tensor, "batch pos"] | None = None
    mask_layers: Bool[Tensor, "batch layer"] | None = None
    mask_heads: Bool[Tensor, "batch head"] | None = None
    capture: dict[int, Tensor] | None = None


def _patched_attention(
    module: nn.Module,
    query: Float[Tensor, "batch head tail d_head"],
    key: Float[Tensor, "batch kv_head tail d_head"],
    value: Float[Tensor, "batch kv_head tail d_head"],
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    kvnotes_variants: Variants | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    if kvnotes_variants is None:
        raise RuntimeError(f"the {NAME} attention needs kvnotes_variants (use kvnotes.run.read_variants)")
    var = kvnotes_variants
    layer_idx: Any = getattr(module, "layer_idx")
    layer = int(layer_idx)
    B, H, T, D = query.shape
    KV = key.shape[1]
    g = H // KV
    scale = scaling if scaling is not None else D**-0.5
    kb, vb = var.base.keys[layer][0], var.base.values[layer][0]  # [kv, N, d]
    N = kb.shape[1]
    q = query.float().reshape(B, KV, g, T, D)  # heads grouped by their kv head
    s_base = torch.einsum("bkgtd,knd->bkgtn", q, kb.float())  # [B, KV, g, T, N]
    s_self = torch.einsum("bkgtd,bksd->bkgts", q, key.float())  # [B, KV, g, T, T]

    pos = var.positions.to(query.device)  # [B, m]
    on = var.layers[:, layer].to(query.device)[:, None] & (pos >= 0)  # [B, m] active patches
    src_idx = pos.clamp(min=0)
    ks = var.src.keys[layer][0].float()[:, src_idx]  # [kv, B, m, d]
    vs = var.src.values[layer][0].float()[:, src_idx]
    dv = vs - vb.float()[:, src_idx]  # value change at patched slots
    s_patch = torch.einsum("bkgtd,kbmd->bkgtm", q, ks)  # [B, KV, g, T, m]
    # inactive slots write into a scratch column N, so they never collide with a real position
    slot = torch.where(on, pos, torch.full_like(pos, N))[:, None, None, None, :].expand(B, KV, g, T, -1)
    s_ext = torch.cat([s_base, s_base.new_zeros(B, KV, g, T, 1)], dim=-1)
    s_base = s_ext.scatter(-1, slot, s_patch)[..., :N]
    scores = torch.cat([s_base, s_self], dim=-1) * scale  # [B, KV, g, T, N+T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap

    key_pos = torch.arange(N + T, device=query.device)
    q_pos = N + torch.arange(T, device=query.device)
    allowed = key_pos[None, :] <= q_pos[:, None]  # causal within the tail [T, N+T]
    if sliding_window is not None:
        allowed &= (q_pos[:, None] - key_pos[None, :]) < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if var.key_mask is not None:
        scores = scores.masked_fill(_knockout(var, layer, B, KV, g, T, query.device), float("-inf"))
    w = torch.softmax(scores, dim=-1)  # [B, KV, g, T, N+T]
    if var.capture is not None:
        var.capture[layer] = w.reshape(B, H, T, N + T).detach().cpu()

    out = torch.einsum("bkgtn,knd->bkgtd", w[..., :N], vb.float())
    out = out + torch.einsum("bkgts,bksd->bkgtd", w[..., N:], value.float())
    w_ext = torch.cat([w[..., :N], w.new_zeros(B, KV, g, T, 1)], dim=-1)
    w_patch = torch.gather(w_ext, -1, slot)  # weight on each patched slot, 0 when inactive
    # a position listed twice in one variant must count once: keep the first occurrence
    w_patch = w_patch * _first_occurrence(pos)[:, None, None, None, :]
    out = out + torch.einsum("bkgtm,kbmd->bkgtd", w_patch, dv)
    out = out.reshape(B, H, T, D).transpose(1, 2).to(query.dtype)  # [B, T, H, d]
    return out, None


def _knockout(
    var: Variants, layer: int, B: int, KV: int, g: int, T: int, device: torch.device
) -> Bool[Tensor, "batch kv_head g 1 key"]:
    """Where the knockout hides keys, shaped to broadcast over the grouped scores."""
    assert var.key_mask is not None
    km = var.key_mask.to(device)  # [B, N]
    if var.mask_layers is not None:
        km = km & var.mask_layers[:, layer].to(device)[:, None]
    km = torch.cat([km, torch.zeros(B, T, dtype=torch.bool, device=device)], 1)  # tail never masked
    full = km[:, None, None, None, :].expand(B, KV, g, 1, -1)
    if var.mask_heads is not None:
        heads = var.mask_heads.to(device).reshape(B, KV, g)[..., None, None]  # query head h = k*g + j
        full = full & heads
    return full


def _first_occurrence(idx: Int[Tensor, "batch m"]) -> Bool[Tensor, "batch m"]:
    same = idx[:, :, None] == idx[:, None, :]  # [B, m, m]
    earlier = torch.ones_like(same[0]).tril(-1).bool()  # j < i
    return ~(same & earlier).any(-1)


def register() -> str:
    """Register the variant attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _patched_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
