"""Gemma 2: alternating sliding/global layers, attention logit soft-capping, so eager attention."""

from kvnotes.models.adapters.base import FamilyAdapter


class Gemma2Adapter(FamilyAdapter):
    family = "gemma2"
    model_types = ("gemma2",)
    attn_implementation = "eager"  # sdpa cannot soft-cap attention logits
    quirks = "eager attention (softcap); embeddings scaled by sqrt(d); sliding layers"
