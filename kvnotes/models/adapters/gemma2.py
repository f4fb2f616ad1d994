"""Gemma 2: alternating sliding/global layers, attention logit soft-capping, so eager attention."""

from typing import Any

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class Gemma2Adapter(FamilyAdapter):
    family = "gemma2"
    model_types = ("gemma2",)
    attn_implementation = "eager"  # sdpa cannot soft-cap attention logits
    quirks = "eager attention (softcap); embeddings scaled by sqrt(d); sliding layers"

    def tiny_config(self) -> Any:
        """Alternating sliding (window 24) and full layers."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import Gemma2Config

        return Gemma2Config(**TINY_COMMON, sliding_window=24, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"] * 2)
