"""Gemma 3: sliding (local, rope base 10k) and global (base 1M, maybe scaled) layers.

The rotary module holds one set of frequencies per layer type, so the cos/sin of a layer are
asked for with that layer's type: a local layer's keys are re-rotated with the local base.
"""

from typing import Any

from torch import Tensor, nn

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class Gemma3Adapter(FamilyAdapter):
    family = "gemma3"
    model_types = ("gemma3", "gemma3_text")
    attn_implementation = "eager"
    quirks = "per-layer-type rope (local 10k / global 1M); q/k norms; sliding layers"

    def _layer_type(self, model: nn.Module, layer: int) -> str:
        return self.layer_types(model)[layer]

    def rope_parameters(self, model, layer):  # type: ignore[no-untyped-def]
        params = getattr(self.text_config(model), "rope_parameters", None) or {}
        return dict(params.get(self._layer_type(model, layer), params))

    def _rotary_call(self, model: nn.Module, x: Tensor, pos: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        return self.rotary(model)(x, pos, self._layer_type(model, layer))

    def _attention_scaling(self, model: nn.Module, layer: int) -> float:
        rot = self.rotary(model)
        return float(getattr(rot, f"{self._layer_type(model, layer)}_attention_scaling", 1.0))

    def tiny_config(self) -> Any:
        """Sliding (window 24) and full layers with per-layer-type rope bases (full: linear scaling)."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **TINY_COMMON, sliding_window=24, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        )
