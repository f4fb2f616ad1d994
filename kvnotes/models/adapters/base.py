"""Where each family keeps its layers, attention, rotary embedding and sliding windows.

Everything family-specific in kvnotes goes through a `FamilyAdapter`; the engine asks the adapter
for the rotary cos/sin of a position (with the rope scaling the family uses and the attention
scaling divided out) and for module paths, and never inspects a model class itself.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor, nn

from kvnotes.models.rope_types import check_rope_type

# Sizes every family's tiny random config shares (`tiny_config`, kvnotes.models.tiny): 4 layers,
# d=64, grouped-query attention (4 query heads over 2 kv heads), a 256-id vocabulary.
TINY_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


class FamilyAdapter:
    """Defaults fit the Llama layout (`model.model.layers[i].self_attn`, `model.model.rotary_emb`)."""

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    attn_implementation: ClassVar[str] = "sdpa"  # eager where the family needs it
    quirks: ClassVar[str] = ""

    def tiny_config(self) -> Any:
        """A tiny random config of this family (`TINY_COMMON` sizes) that exercises its quirk."""
        raise NotImplementedError(f"no tiny config for family {self.family!r}")

    # --- module paths -------------------------------------------------------------------
    def decoder(self, model: nn.Module) -> nn.Module:
        return model.model  # type: ignore[return-value]

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.decoder(model).layers  # type: ignore[return-value]

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.layers(model)[layer].self_attn  # type: ignore[return-value]

    def o_proj(self, model: nn.Module, layer: int) -> nn.Linear:
        return self.attention(model, layer).o_proj  # type: ignore[return-value]

    def rotary(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).rotary_emb  # type: ignore[return-value]

    def final_norm(self, model: nn.Module) -> nn.Module:
        return self.decoder(model).norm  # type: ignore[return-value]

    def unembed(self, model: nn.Module) -> nn.Module:
        return model.lm_head  # type: ignore[return-value]

    # --- config facts -------------------------------------------------------------------
    def text_config(self, model: nn.Module) -> Any:
        config: Any = model.config
        return config.get_text_config(decoder=True)

    def layer_types(self, model: nn.Module) -> list[str]:
        cfg = self.text_config(model)
        types = getattr(cfg, "layer_types", None)
        return list(types) if types else ["full_attention"] * cfg.num_hidden_layers

    def sliding_window(self, model: nn.Module, layer: int) -> int | None:
        """Window of a sliding-attention layer, None for full attention."""
        if self.layer_types(model)[layer] != "sliding_attention":
            return None
        return getattr(self.text_config(model), "sliding_window", None)

    def rope_parameters(self, model: nn.Module, layer: int) -> dict[str, Any]:
        params = getattr(self.text_config(model), "rope_parameters", None) or {}
        return dict(params)

    def head_dim(self, model: nn.Module) -> int:
        cfg = self.text_config(model)
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    def n_heads(self, model: nn.Module) -> int:
        return int(self.text_config(model).num_attention_heads)

    def n_kv_heads(self, model: nn.Module) -> int:
        cfg = self.text_config(model)
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    # --- rotary -------------------------------------------------------------------------
    def _rotary_call(self, model: nn.Module, x: Tensor, pos: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        return self.rotary(model)(x, pos)

    def _attention_scaling(self, model: nn.Module, layer: int) -> float:
        return float(getattr(self.rotary(model), "attention_scaling", 1.0))

    def rope_cos_sin(
        self, model: nn.Module, positions: Tensor, layer: int
    ) -> tuple[Float[Tensor, "pos d_head"], Float[Tensor, "pos d_head"]]:
        """cos/sin of the model's own rotary embedding at `positions`, fp32, scaling divided out.

        YaRN and friends fold `attention_scaling` into cos and sin; a pure rotation must not carry
        it, so it is divided out here (rotating twice would otherwise scale keys twice).
        """
        params = self.rope_parameters(model, layer)  # dynamic, longrope, partial: refused
        check_rope_type(str(params.get("rope_type", "default")), layer,
                        float(params.get("partial_rotary_factor", 1.0)))
        pos = positions.reshape(1, -1).to(torch.long)
        device = next(model.parameters()).device
        x = torch.zeros(1, dtype=torch.float32, device=device)
        cos, sin = self._rotary_call(model, x, pos.to(device), layer)  # [1, pos, d_head]
        scale = self._attention_scaling(model, layer)
        return cos[0].float() / scale, sin[0].float() / scale
