"""Gradients of a readout with respect to the KV cache: one forward and one backward.

A few tail tokens run after a cached prefix whose K/V are leaf tensors: each layer's attention
reads [cache | tail] keys and values, the cache ones straight from the leaves (as
`kvnotes.engine.attention` reads its variants), so nothing else reads them and dS/dK, dS/dV are
the cache's own gradients. A scalar score of the last position's fp32 logits is differentiated
with respect to every layer's cached keys (post-RoPE, as stored) and values, and to the tail's
attention probabilities over [cache | tail] (AtP*'s QK fix reads them: dS/dA[h, t, j]). The
forward runs in the model's dtype; the attention itself in fp32, as the variant reads do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, as_ids, attention_impl, check_positions
from kvnotes.models.loading import LoadedModel

NAME = "kvnotes_gradients"


@dataclass
class _Tape:
    """What the attention reads (the cache leaves) and what it leaves behind per layer."""

    keys: tuple[Tensor, ...]  # leaves [1, kv_head, N, d_head]
    values: tuple[Tensor, ...]
    probs: dict[int, Tensor] = field(default_factory=dict)  # [head, tail, N + tail], in the graph
    scores: dict[int, Tensor] = field(default_factory=dict)  # [head, tail, N] pre-softmax, detached
    queries: dict[int, Tensor] = field(default_factory=dict)  # [head, tail, d_head], scaled, detached
    softcap: dict[int, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheGradients:
    """dS/d(cache) and the tail's attention at one clean forward (fp32, on the model's device).

    Per layer: `grad_keys`/`grad_values` [kv_head, N, d_head]; `probs`/`grad_probs` [head, tail,
    N + tail] (query head h reads kv head h // (heads / kv_heads)); `scores` [head, tail, N] the
    pre-softmax scores over the cache after soft-capping, -inf where a key is hidden (sliding
    window); `queries` [head, tail, d_head] already multiplied by the attention scale, so a key k
    scores softcap(q . k); `softcap` the layer's attention soft-capping (None: none).
    """

    score: float
    grad_keys: tuple[Float[Tensor, "kv_head pos d_head"], ...]
    grad_values: tuple[Float[Tensor, "kv_head pos d_head"], ...]
    probs: tuple[Float[Tensor, "head tail key"], ...]
    grad_probs: tuple[Float[Tensor, "head tail key"], ...]
    scores: tuple[Float[Tensor, "head tail pos"], ...]
    queries: tuple[Float[Tensor, "head tail d_head"], ...]
    softcap: tuple[float | None, ...]

    def rescore(self, layer: int, keys: Float[Tensor, "kv_head pos d_head"]) -> Float[Tensor, "head tail pos"]:
        """The pre-softmax scores the tail would give `keys` (same positions) at `layer`: hidden
        positions stay -inf."""
        q = self.queries[layer]  # [H, T, d]
        group = q.shape[0] // keys.shape[0]
        k = keys.float().repeat_interleave(group, dim=0)  # [KV, N, d] -> [H, N, d]
        s = torch.einsum("htd,hnd->htn", q, k)
        cap = self.softcap[layer]
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        return s.masked_fill(torch.isinf(self.scores[layer]), float("-inf"))


def _grad_attention(
    module: nn.Module,
    query: Float[Tensor, "batch head tail d_head"],
    key: Float[Tensor, "batch kv_head tail d_head"],
    value: Float[Tensor, "batch kv_head tail d_head"],
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    kvnotes_tape: _Tape | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    if kvnotes_tape is None:
        raise RuntimeError(f"the {NAME} attention needs kvnotes_tape (use kvnotes.engine.gradients.cache_gradients)")
    tape = kvnotes_tape
    layer = int(getattr(module, "layer_idx"))
    B, H, T, D = query.shape
    if B != 1:
        raise ValueError(f"the gradient attention runs batch 1, got {B}")
    KV = key.shape[1]
    g = H // KV
    scale = scaling if scaling is not None else D**-0.5
    kc, vc = tape.keys[layer], tape.values[layer]  # [1, KV, N, d]
    N = kc.shape[2]
    k_all = torch.cat([kc.expand(B, -1, -1, -1).to(key.dtype), key], dim=2).float()  # [B, KV, N+T, d]
    v_all = torch.cat([vc.expand(B, -1, -1, -1).to(value.dtype), value], dim=2).float()
    q = query.float().reshape(B, KV, g, T, D) * scale  # heads grouped by their kv head
    s = torch.einsum("bkgtd,bknd->bkgtn", q, k_all)  # [B, KV, g, T, N+T]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    q_pos = N + torch.arange(T, device=query.device)
    k_pos = torch.arange(N + T, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]  # [T, N+T] causal
    if sliding_window is not None:
        hidden = hidden | ((q_pos[:, None] - k_pos[None, :]) >= sliding_window)
    s = s.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(s, dim=-1).reshape(H, T, N + T)  # batch 1; dS/dA is taken at this tensor
    tape.probs[layer] = probs
    tape.scores[layer] = s[0, ..., :N].detach().reshape(H, T, N)
    tape.queries[layer] = q[0].detach().reshape(H, T, D)
    tape.softcap[layer] = softcap
    out = torch.einsum("bkgtn,bknd->bkgtd", probs.reshape(B, KV, g, T, N + T), v_all)
    return out.reshape(B, H, T, D).transpose(1, 2).to(query.dtype), None  # [B, T, H, d]


def register() -> str:
    """Register the gradient attention with transformers (idempotent); returns its name."""
    # deferred: transformers is heavy and only this path needs it
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _grad_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def cache_gradients(
    model: LoadedModel,
    cache: KVCache,
    ids: Ids,
    score: Callable[[Float[Tensor, "tail vocab"]], Tensor],
) -> CacheGradients:
    """One forward of `ids` after `cache` (batch 1) and one backward of `score(logits)`, a scalar
    of the fp32 logits of every tail position ([tail, vocab]), to the cache and the tail's
    attention probabilities. `cache` is not changed (its leaves are copies)."""
    x = as_ids(model, ids)
    if cache.batch != 1 or x.shape[0] != 1:
        raise ValueError("cache_gradients takes a batch-1 cache and one tail")
    n, t = cache.seq_len, x.shape[1]
    check_positions(model, n, t)
    with torch.inference_mode(False), torch.enable_grad():
        dev = model.device
        keys = tuple(k.to(dev).clone().requires_grad_(True) for k in cache.keys)
        values = tuple(v.to(dev).clone().requires_grad_(True) for v in cache.values)
        tape = _Tape(keys, values)
        pos = torch.arange(n, n + t, device=dev)[None]  # [1, tail]
        kw: dict[str, Any] = dict(input_ids=x.clone(), position_ids=pos, use_cache=False,
                                  kvnotes_tape=tape, logits_to_keep=0)
        with attention_impl(model, register()):
            logits = model.hf(**kw).logits.float()[0]  # [tail, vocab]
        s = score(logits)
        if s.numel() != 1:
            raise ValueError(f"the score must be a scalar, got shape {tuple(s.shape)}")
        layers = range(model.n_layers)
        probs = [tape.probs[i] for i in layers]
        grads = torch.autograd.grad(s.reshape(()), [*keys, *values, *probs], allow_unused=True)
    L = len(keys)

    def dense(gr: Tensor | None, like: Tensor) -> Tensor:
        return (torch.zeros_like(like) if gr is None else gr).detach().float()

    return CacheGradients(
        score=float(s.detach()),
        grad_keys=tuple(dense(grads[i], keys[i])[0] for i in layers),
        grad_values=tuple(dense(grads[L + i], values[i])[0] for i in layers),
        probs=tuple(p.detach() for p in probs),
        grad_probs=tuple(dense(grads[2 * L + i], probs[i]) for i in layers),
        scores=tuple(tape.scores[i] for i in layers),
        queries=tuple(tape.queries[i] for i in layers),
        softcap=tuple(tape.softcap[i] for i in layers),
    )
