"""Qwen3: Llama layout plus per-head RMSNorm on q and k before rope; YaRN for long contexts."""

from kvnotes.models.adapters.base import FamilyAdapter


class Qwen3Adapter(FamilyAdapter):
    family = "qwen3"
    model_types = ("qwen3",)
    quirks = "q_norm/k_norm before rope (cached keys are normed and rotated); YaRN attention_scaling"
