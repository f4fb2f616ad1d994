"""Re-rotate cached keys by a position delta with the model's own rotary embedding.

RoPE rotates each 2-D frequency pair of a key at position p by the angle p*theta_i, so
R(p + delta) = R(delta) R(p): a key cached at position p moves to p + delta with a single
rotation by delta, whatever p was. cos/sin come from the model's rotary module (its inverse
frequencies, llama3 or linear scaling, Gemma 3's per-layer-type bases) in fp32, with YaRN's
`attention_scaling` divided out so the rotation stays a pure rotation. That identity needs
frequencies that do not depend on the sequence: rope types outside
`kvnotes.models.rope_types.STATIC_ROPE_TYPES` (dynamic
NTK, longrope, anything newer) and partial rotary are refused with `UnsupportedRopeError`
instead of being rotated wrongly (longrope switches to its long factors past
original_max_position_embeddings, so a key moved there from a short block is off by ~1).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine.cache import KVCache
from kvnotes.models.loading import LoadedModel
from kvnotes.models.rope_types import UnsupportedRopeError, check_rope_type


def rope_facts(model: LoadedModel) -> list[dict[str, Any]]:
    """Per layer: the rope type and scaling, attention scaling, sliding window, and whether
    kvnotes can re-rotate its keys (the facts a transplant relies on)."""
    ad, hf = model.adapter, model.hf
    cfg = model.config
    out = []
    for i, kind in enumerate(ad.layer_types(hf)):
        params = ad.rope_parameters(hf, i)
        rope_type = str(params.get("rope_type", "default"))
        partial = float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0) or 1.0))
        try:
            check_rope_type(rope_type, i, partial)
            why = ""
        except UnsupportedRopeError as e:
            why = str(e)
        out.append({
            "layer": i, "layer_type": kind, "rope_type": rope_type,
            "rope_theta": params.get("rope_theta"), "factor": params.get("factor"),
            "original_max_position_embeddings": params.get("original_max_position_embeddings"),
            "partial_rotary_factor": partial,
            "attention_scaling": ad._attention_scaling(hf, i),
            "sliding_window": ad.sliding_window(hf, i),
            "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
            "supported": not why, "unsupported_reason": why,
        })
    return out


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (the HF rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_keys(
    model: LoadedModel,
    keys: Float[Tensor, "batch kv_head pos d_head"],
    delta: int,
    layer: int,
) -> Float[Tensor, "batch kv_head pos d_head"]:
    """Keys of `layer` moved by `delta` positions (delta may be negative), in the keys' dtype."""
    if delta == 0:
        return keys
    cos, sin = model.adapter.rope_cos_sin(model.hf, torch.tensor([delta]), layer)  # [1, d_head]
    d = keys.shape[-1]
    if cos.shape[-1] != d:
        raise ValueError(f"rotary dim {cos.shape[-1]} != key dim {d}; partial rotary is not supported")
    k = keys.float()
    cos = cos.to(k.device)[None, None]  # [1, 1, 1, d_head]
    sin = sin.to(k.device)[None, None]
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


def reposition(model: LoadedModel, cache: KVCache, delta: int) -> KVCache:
    """Every key of `cache` moved by `delta` positions; values are position-free and kept."""
    keys = tuple(rotate_keys(model, k, delta, i) for i, k in enumerate(cache.keys))
    return KVCache(keys, cache.values)
