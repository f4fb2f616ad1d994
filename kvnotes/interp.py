"""Activation reads and head-level patches through nnsight, with module paths from the family adapter.

`residual_stream` reads the residual stream after every decoder layer (resid_post). A head's
output is its slice of the o_proj input (TransformerLens' z), `[n_heads * d_head] -> [n_heads,
d_head]`; since o_proj is linear, replacing that slice swaps the head's whole contribution
W_O^h z^h to the residual stream. nnsight serves a trace in execution order, so reads and writes
are issued layer by layer, ascending; and only `.save()`d values leave a trace (a list built
inside one is dropped), so results are collected into containers made before the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from kvnotes.models.loading import LoadedModel
from kvnotes.run import Ids, as_ids


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
