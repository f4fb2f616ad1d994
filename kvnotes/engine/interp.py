"""Activation reads, head-level patches and key knockouts, with module paths from the family adapter.

`residual_stream` reads the residual stream after every decoder layer (resid_post). A head's
output is its slice of the o_proj input (TransformerLens' z), `[n_heads * d_head] -> [n_heads,
d_head]`; since o_proj is linear, replacing that slice swaps the head's whole contribution
W_O^h z^h to the residual stream. nnsight serves a trace in execution order, so reads and writes
are issued layer by layer, ascending; and only `.save()`d values leave a trace (a list built
inside one is dropped), so results are collected into containers made before the trace.

`patch_heads_at_tail` does the same swap for many head sets at once: only the tail token's heads
change, and no earlier position can see them, so the dst run is its cache plus the tail, read as
a batch of variants over one shared cache (kvnotes.engine.variants.read_variants) with an o_proj pre-hook.
`hide_keys` removes chosen keys from the attention of every later query (an additive -inf in a
4D mask, all layers): the information written there reaches nothing downstream, unlike the
decision-only knockout of kvnotes.engine.attention, where positions after the notes keep what they read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn

from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, additive_masks, as_ids
from kvnotes.engine.variants import read_variants
from kvnotes.models.loading import LoadedModel


def _envoy(model: LoadedModel, module: nn.Module) -> Any:
    """The nnsight envoy of a submodule of `model.hf` (found by identity, not by name)."""
    for name, candidate in model.hf.named_modules():
        if candidate is module:
            return model.nnsight.get(name) if name else model.nnsight
    raise ValueError(f"{type(module).__name__} is not a submodule of {model.name}")


def _hidden(output: Any) -> Tensor:
    """A decoder layer returns the hidden states, or a tuple starting with them."""
    return output[0] if isinstance(output, tuple) else output


def _one(model: LoadedModel, ids: Ids) -> Tensor:
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError(f"expected a single sequence, got batch {x.shape[0]}")
    return x


@torch.no_grad()
def residual_stream(model: LoadedModel, ids: Ids) -> Float[Tensor, "layer pos d_model"]:
    """The residual stream after each decoder layer (before the final norm), fp32."""
    x = _one(model, ids)
    layers = [_envoy(model, layer) for layer in model.adapter.layers(model.hf)]
    saved: list[Any] = []
    with model.nnsight.trace(x):
        for layer in layers:  # execution order: ascending
            saved.append(layer.output.save())
    return torch.stack([_hidden(s)[0] for s in saved]).float()  # [layer, pos, d_model]


def _heads_by_layer(model: LoadedModel, heads: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    n_layers, n_heads = model.n_layers, model.adapter.n_heads(model.hf)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise IndexError(f"head ({layer}, {head}) out of range: {n_layers} layers x {n_heads} heads")
        by_layer.setdefault(layer, []).append(head)
    return dict(sorted(by_layer.items()))


def _position(pos: int, length: int) -> int:
    if not -length <= pos < length:
        raise IndexError(f"position {pos} out of range for {length} tokens")
    return pos % length


@torch.no_grad()
def patch_head_outputs(
    model: LoadedModel,
    ids_dst: Ids,
    ids_src: Ids,
    heads: Sequence[tuple[int, int]],
    pos: int = -1,
) -> Float[Tensor, " vocab"]:
    """Logits of the dst run at `pos` after its `heads` ((layer, head) pairs) output there what
    they output at `pos` in the src run.

    `pos` indexes each sequence on its own (-1: the last token of each), so the prompts may
    differ in length. Positions after `pos` are not patched; earlier ones cannot see the patch.
    """
    dst, src = _one(model, ids_dst), _one(model, ids_src)
    p_dst, p_src = _position(pos, dst.shape[1]), _position(pos, src.shape[1])
    by_layer = _heads_by_layer(model, heads)
    d_head = model.adapter.head_dim(model.hf)
    o_proj = {layer: _envoy(model, model.adapter.o_proj(model.hf, layer)) for layer in by_layer}
    z_src: dict[int, Tensor] = {}  # layer -> [n_heads * d_head]
    with model.nnsight.trace(src):
        for layer, o in o_proj.items():
            z_src[layer] = o.input[0, p_src].clone().save()
    with model.nnsight.trace(dst):
        for layer, o in o_proj.items():  # ascending layers
            z = o.input  # [1, pos, n_heads * d_head]
            for h in by_layer[layer]:
                z[0, p_dst, h * d_head : (h + 1) * d_head] = z_src[layer][h * d_head : (h + 1) * d_head]
        logits = model.nnsight.output.logits[0, p_dst].save()
    return logits.float()


def _o_proj_inputs(model: LoadedModel) -> list[nn.Module]:
    return [model.adapter.o_proj(model.hf, layer) for layer in range(model.n_layers)]


@torch.no_grad()
def tail_head_outputs(model: LoadedModel, cache: KVCache, tail: Ids) -> Float[Tensor, "layer head d_head"]:
    """Every head's output z at the last tail token, run after `cache` (fp32 copy)."""
    H, d = model.adapter.n_heads(model.hf), model.adapter.head_dim(model.hf)
    z: dict[int, Tensor] = {}

    def grab(layer: int) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            z[layer] = args[0][0, -1].detach().float().cpu()  # [H * d]
        return hook

    handles = [m.register_forward_pre_hook(grab(i)) for i, m in enumerate(_o_proj_inputs(model))]
    try:
        read_variants(model, cache, cache, [[]], tail)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([z[layer].reshape(H, d) for layer in range(model.n_layers)])  # [layer, H, d]


@torch.no_grad()
def patch_heads_at_tail(
    model: LoadedModel,
    cache: KVCache,
    tail: Ids,
    z_src: Float[Tensor, "layer head d_head"],
    heads: Bool[Tensor, "n layer head"],
    batch_size: int = 64,
    at: int = -1,
    all_rows: bool = False,
) -> Float[Tensor, "n *tail vocab"]:
    """Last-tail-token logits after `cache` when, in variant i, the heads `heads[i]` output z_src.

    Equal to `patch_head_outputs(dst, src, chosen heads)` when `cache` + `tail` is the dst prompt
    and z_src the src prompt's tail outputs (`tail_head_outputs`): earlier positions are not
    patched there either, and the tail is the only position that sees the patch. `at`: the tail
    position whose heads are patched (the decision token of a teacher-forced tail is 0);
    `all_rows`: the logits of every tail position ([n, tail, vocab]), not only the last.
    """
    L, H, d = z_src.shape
    if heads.ndim != 3 or tuple(heads.shape[1:]) != (L, H) or L != model.n_layers:
        raise ValueError(f"heads must be [n, {model.n_layers}, {H}], got {tuple(heads.shape)}")
    chunk: dict[str, Tensor] = {}

    def put(layer: int) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0].clone()  # [b, tail, H * d]
            on = chunk["heads"][:, layer].to(x.device)  # [b, H]
            if not bool(on.any()):
                return args
            last = x[:, at].reshape(x.shape[0], H, d)  # [b, H, d]
            src = z_src[layer].to(device=x.device, dtype=x.dtype)[None]  # [1, H, d]
            x[:, at] = torch.where(on[..., None], src, last).reshape(x.shape[0], H * d)
            return (x, *args[1:])
        return hook

    handles = [m.register_forward_pre_hook(put(i)) for i, m in enumerate(_o_proj_inputs(model))]
    out = []
    try:
        for s in range(0, heads.shape[0], batch_size):
            chunk["heads"] = heads[s : s + batch_size]
            b = chunk["heads"].shape[0]
            logits = read_variants(model, cache, cache, [[]] * b, tail, batch_size=b)  # [b, tail, vocab]
            out.append(logits if all_rows else logits[:, -1])
    finally:
        for h in handles:
            h.remove()
    return torch.cat(out).float()


def _hide_masks(model: LoadedModel, hidden: Bool[Tensor, "batch pos"]) -> Tensor | dict[str, Tensor]:
    """Additive 4D masks [batch, 1, q, k]: causal, sliding windows per layer type, and key k in
    `hidden[b]` invisible to every later query q > k (each position still sees itself)."""
    n = hidden.shape[1]
    dev = model.device
    q = torch.arange(n, device=dev)
    causal = q[None, :] <= q[:, None]  # [q, k]
    later = q[:, None] > q[None, :]  # [q, k]: strictly after the key
    allowed = causal[None] & ~(hidden.to(dev)[:, None, :] & later[None])  # [B, q, k]
    return additive_masks(model, q, q, allowed)  # sliding windows per layer type, [B, 1, q, k]


@torch.no_grad()
def hide_keys(
    model: LoadedModel, ids: Ids, hidden: Bool[Tensor, "n pos"], batch_size: int = 8, keep: int | None = None
) -> Float[Tensor, "n *keep vocab"]:
    """Last-position logits of `ids` when, in variant i, the keys `hidden[i]` are removed from the
    attention of every later query, in every layer and head (a cache-free forward per variant).
    `keep`: the logits of the last `keep` positions ([n, keep, vocab]) instead."""
    x = _one(model, ids)
    n = x.shape[1]
    if hidden.ndim != 2 or hidden.shape[1] != n:
        raise ValueError(f"hidden must be [variants, {n}], got {tuple(hidden.shape)}")
    out = []
    for s in range(0, hidden.shape[0], batch_size):
        h = hidden[s : s + batch_size]
        pos = torch.arange(n, device=model.device)[None].expand(h.shape[0], -1)
        res = model.hf(input_ids=x.expand(h.shape[0], -1), attention_mask=_hide_masks(model, h),
                       position_ids=pos, use_cache=False, logits_to_keep=keep or 1)
        out.append(res.logits.float() if keep else res.logits[:, -1].float())
    return torch.cat(out)
