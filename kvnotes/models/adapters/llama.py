"""Llama (SmolLM2, Llama-3.x): the default layout; Llama 3 folds `llama3` scaling into inv_freq."""

from kvnotes.models.adapters.base import FamilyAdapter


class LlamaAdapter(FamilyAdapter):
    family = "llama"
    model_types = ("llama",)
    quirks = "llama3 rope scaling lives in inv_freq; SmolLM2 ties embeddings"
