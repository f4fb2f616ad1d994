"""Qwen2 / Qwen2.5: Llama layout with q/k/v biases; sliding window is off in every released config."""

from kvnotes.models.adapters.base import FamilyAdapter


class Qwen2Adapter(FamilyAdapter):
    family = "qwen2"
    model_types = ("qwen2",)
    quirks = "qkv biases; use_sliding_window false in released checkpoints"
