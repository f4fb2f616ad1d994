"""Mistral: Llama layout; v0.1 used a 4k sliding window on every layer, v0.3 none."""

from typing import Any

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class MistralAdapter(FamilyAdapter):
    family = "mistral"
    model_types = ("mistral",)
    quirks = "config.sliding_window applies to every layer when set"

    def layer_types(self, model):  # type: ignore[no-untyped-def]
        cfg = self.text_config(model)
        kind = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
        return [kind] * cfg.num_hidden_layers

    def tiny_config(self) -> Any:
        """A sliding window (24) shorter than the test sequences, on every layer."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import MistralConfig

        return MistralConfig(**TINY_COMMON, sliding_window=24)
