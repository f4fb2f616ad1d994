"""Llama (SmolLM2, Llama-3.x): the default layout; Llama 3 folds `llama3` scaling into inv_freq."""

from typing import Any

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    family = "llama"
    model_types = ("llama",)
    quirks = "llama3 rope scaling lives in inv_freq; SmolLM2 ties embeddings"

    def tiny_config(self) -> Any:
        """llama3 rope scaling (inv_freq rescaled beyond 64 original positions)."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import LlamaConfig

        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return LlamaConfig(**TINY_COMMON, rope_parameters=rope)
