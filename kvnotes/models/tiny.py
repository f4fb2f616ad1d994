"""Tiny random models of every supported family, for exactness tests in seconds.

Each config exercises its family's quirk: llama3 rope scaling (llama), YaRN attention_scaling
(qwen3), q/k/v biases (qwen2), a sliding window shorter than the test sequences (mistral, gemma2,
gemma3) and gemma3's per-layer-type rope bases.
"""

from __future__ import annotations

from typing import Any

import torch

from kvnotes.models.adapters import FAMILIES, adapter_for
from kvnotes.models.loading import LoadedModel, wrap_model

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_config(family: str) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    c = dict(_COMMON)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return LlamaConfig(**c, rope_parameters=rope)
    if family == "qwen2":
        return Qwen2Config(**c, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64}
        return Qwen3Config(**c, rope_parameters=rope)
    if family == "mistral":
        return MistralConfig(**c, sliding_window=24)
    if family == "gemma2":
        return Gemma2Config(**c, sliding_window=24, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"] * 2)
    if family == "gemma3":
        return Gemma3TextConfig(
            **c, sliding_window=24, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        )
    raise KeyError(f"no tiny config for {family!r}; families: {', '.join(FAMILIES)}")


def tiny_tokenizer() -> Any:
    """A character-level tokenizer in memory (< 256 ids, fits every tiny model).

    A space and the character after it form one token, so words keep distinct first tokens
    (" grant" -> " g"), as the decision readout of task items needs.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "\n", *(chr(c) for c in range(32, 127))]
    vocab = chars + [" " + c for c in chars[3:]]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens are pieces of text: join them as they are
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A randomly initialised model of `family` (4 layers, d=64) with `tiny_tokenizer()`."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg._attn_implementation = adapter_for(family).attn_implementation
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return wrap_model(hf, tiny_tokenizer(), name=f"tiny-{family}")
