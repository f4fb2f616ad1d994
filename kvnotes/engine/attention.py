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

from kvnotes.engine.cache import KVCache

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
        raise RuntimeError(f"the {NAME} attention needs kvnotes_variants (use kvnotes.engine.variants.read_variants)")
    var = kvnotes_variants
    layer_idx: Any = getattr(module, "layer_idx")
    layer = int(layer_idx)
    B, H, T, D = query.shape
    KV = key.shape[1]
    g = H // KV
    scale = scaling if scaling is not None else D**-0.5
    dev = query.device
    kb, vb = var.base.keys[layer][0].float(), var.base.values[layer][0].float()  # [kv, N, d]
    N = kb.shape[1]
    q = query.float().reshape(B, KV, g, T, D)  # heads grouped by their kv head
    # scores over the shared cache, written once and then changed in place: [B, KV, g, T, N]
    # (einsum runs one bmm per kv head with (b, g, t) as rows; the base cache is never expanded)
    s = torch.einsum("bkgtd,knd->bkgtn", q * scale, kb)
    s_self = torch.einsum("bkgtd,bksd->bkgts", q, key.float()) * scale  # [B, KV, g, T, T]

    pos = var.positions.to(dev)  # [B, m]
    on = var.layers[:, layer].to(dev)[:, None] & (pos >= 0)  # [B, m] active patches
    src_idx = pos.clamp(min=0)
    ks = var.src.keys[layer][0].float()[:, src_idx]  # [kv, B, m, d]
    vs = var.src.values[layer][0].float()[:, src_idx]
    dv = vs - vb[:, src_idx]  # value change at patched slots
    if bool(on.any()):  # patched slots read the source keys: s[b, ..., p] = q_b . k_src[p]
        bi, ji = on.nonzero(as_tuple=True)
        s_patch = torch.einsum("bkgtd,kbmd->bmkgt", q[bi] * scale, ks[:, bi, ji][:, :, None])
        s.permute(0, 4, 1, 2, 3)[bi, pos[bi, ji]] = s_patch[:, 0]  # [n_active, KV, g, T]
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
        s_self = torch.tanh(s_self / softcap) * softcap
    q_pos = N + torch.arange(T, device=dev)
    tail = torch.arange(T, device=dev)
    hidden_self = tail[None, :] > tail[:, None]  # causal within the tail [T, T]
    if sliding_window is not None:
        hidden_self |= (tail[:, None] - tail[None, :]) >= sliding_window
        if N + T > sliding_window:  # base keys beyond the window, by position
            far = (q_pos[:, None] - torch.arange(N, device=dev)[None, :]) >= sliding_window  # [T, N]
            s.masked_fill_(far, float("-inf"))
    s_self = s_self.masked_fill(hidden_self, float("-inf"))
    if var.key_mask is not None:
        s.masked_fill_(_knockout(var, layer, B, KV, g, T, dev)[..., :N], float("-inf"))
    # softmax over [base | tail] without concatenating: exp(s - max), normalised at the end
    top = torch.maximum(s.amax(-1, keepdim=True), s_self.amax(-1, keepdim=True))  # [B, KV, g, T, 1]
    s.sub_(top).exp_()
    e_self = (s_self - top).exp()
    z = s.sum(-1, keepdim=True) + e_self.sum(-1, keepdim=True)
    if var.capture is not None:
        var.capture[layer] = (torch.cat([s, e_self], dim=-1) / z).reshape(B, H, T, N + T).detach().cpu()

    out = torch.einsum("bkgtn,knd->bkgtd", s, vb)
    out = out + torch.einsum("bkgts,bksd->bkgtd", e_self, value.float())
    slot = pos.clamp(min=0)[:, None, None, None, :].expand(B, KV, g, T, -1)  # [B, KV, g, T, m]
    w_patch = torch.gather(s, -1, slot)  # unnormalised weight on each patched slot
    # inactive slots and a position listed twice in one variant (after its first) count zero
    w_patch = w_patch * (on & _first_occurrence(pos))[:, None, None, None, :]
    out = (out + torch.einsum("bkgtm,kbmd->bkgtd", w_patch, dv)) / z
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
    # deferred: transformers is heavy and only this path needs it
    from transformers import AttentionInterface

    # deferred: transformers is heavy and only this path needs it
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _patched_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
