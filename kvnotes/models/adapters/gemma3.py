"""Gemma 3: sliding (local, rope base 10k) and global (base 1M, maybe scaled) layers.

The rotary module holds one set of frequencies per layer type, so the cos/sin of a layer are
asked for with that layer's type: a local layer's keys are re-rotated with the local base.
"""

from torch import Tensor, nn

from kvnotes.models.adapters.base import FamilyAdapter


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
