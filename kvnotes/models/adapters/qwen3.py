"""Qwen3: Llama layout plus per-head RMSNorm on q and k before rope; YaRN for long contexts."""

from typing import Any

from kvnotes.models.adapters.base import TINY_COMMON, FamilyAdapter


class Qwen3Adapter(FamilyAdapter):
    family = "qwen3"
    model_types = ("qwen3",)
    quirks = "q_norm/k_norm before rope (cached keys are normed and rotated); YaRN attention_scaling"

    def tiny_config(self) -> Any:
        """YaRN: attention_scaling folded into cos/sin."""
        # deferred: transformers is heavy and only this path needs it
        from transformers import Qwen3Config

        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64}
        return Qwen3Config(**TINY_COMMON, rope_parameters=rope)
