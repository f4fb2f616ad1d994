"""Qwen2 / Qwen2.5: Llama layout with q/k/v biases; sliding window is off in every released config."""

from typing import Any

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    family = "qwen2"
    model_types = ("qwen2",)
    quirks = "qkv biases; use_sliding_window false in released checkpoints"

    def tiny_config(self) -> Any:
        """q/k/v biases (Qwen2's default), plain rope."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import Qwen2Config

        return Qwen2Config(**TINY_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
