"""Folders with the architecture of a hub model these machines cannot fetch, for timing and memory.

    python -m benchmarks.shapes llama-3.1-8b OUT_DIR
    python -m benchmarks.engine --model OUT_DIR --random-init --device cuda --memory-cap-gib 80

A folder holds the model's config.json (its published sizes, written out below) and the
tokenizer of a packaged model (SmolLM2's by default: its 49,152 ids fit every vocabulary here),
no weights. `kvnotes.models.tiny.random_model` builds the model from it with random weights on
the device. Its FLOPs, memory traffic and KV-cache sizes are the real model's, so its timings and
peak memory are; its logits are noise, so every cosine or greedy token read from it is not a
reading (benchmarks.engine marks a `--random-init` run `weights: random`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvnotes.models import load_tokenizer

# Published config.json values (meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B), sizes only.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "torch_dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    },
}


def write(name: str, out: Path, tokenizer: str = "llama") -> Path:
    """Write `name`'s config.json and the packaged model `tokenizer`'s tokenizer files to `out`."""

    if name not in SHAPES:
        raise KeyError(f"no shape {name!r}; known: {', '.join(SHAPES)}")
    tok = load_tokenizer(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out / "config.json").write_text(json.dumps({**SHAPES[name], **ids}, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shapes", description=__doc__.split("\n")[0])
    p.add_argument("shape", help=", ".join(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", default="llama", help="a packaged model whose tokenizer the folder gets")
    a = p.parse_args(argv)
    if a.shape not in SHAPES:
        print(f"error: no shape {a.shape!r}; known: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    print(write(a.shape, a.out, a.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
