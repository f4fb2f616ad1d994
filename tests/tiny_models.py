"""Tiny random models beside the conftest fixtures that tests in several folders build."""

from __future__ import annotations

import torch


def longrope_model():
    """A tiny llama with longrope: short factors up to 64 positions, long factors past them."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvnotes.models import wrap_model
    from kvnotes.models.adapters.base import TINY_COMMON
    from kvnotes.models.tiny import tiny_tokenizer

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8, "original_max_position_embeddings": 64, "factor": 4.0}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_COMMON, rope_parameters=rope))
    return wrap_model(hf, tiny_tokenizer(), name="tiny-longrope")
