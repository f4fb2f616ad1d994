"""How long a prompt a run can afford, decided from config files before any weights load.

Two bounds on `task.length` (L tokens per prompt, n items):
* positions: L <= max_position_embeddings, read from the model's config.json (the converted
  folder of a packaged model, the local HF cache of a hub model). A tiny random model has no
  trained context, so it has no position bound.
* memory: items held while they are built, n * L * 256 B, plus one item being built, L * 1 KiB
  (measured: ~70-230 B/token held, ~200-540 B/token peak, with the SmolLM2 tokenizer), plus a
  forward pass: 4 copies of the KV cache, 4 * L * 2 * layers * kv_heads * head_dim * dtype bytes
  (old, new, patched and spare), and one layer's fp32 attention scores, heads * L^2 * 4 B
  (eager attention materialises them), plus the weights on disk. The estimate is an order of
  magnitude: it refuses `task.length=10000000` at once instead of after 8 GB of item building;
  it does not promise that a run under it fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvnotes.measure import timing
from kvnotes.models import cache_dir as kv_cache
from kvnotes.models import get_spec
from kvnotes.models.tiny import tiny_config

HELD_BYTES_PER_TOKEN = 256  # per item and prompt token, while the run holds its items
BUILD_BYTES_PER_TOKEN = 1024  # peak of building one item
KV_COPIES = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the bounds need from a model's config.json."""

    max_positions: int | None  # None: no bound (tiny random model)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    weights_bytes: int  # on disk; 0 when unknown
    source: str  # the file the shape was read from

    @classmethod
    def from_config(cls, c: dict[str, Any], source: str, weights_bytes: int = 0,
                    positions: bool = True) -> ModelShape:
        c = c.get("text_config") or c  # multimodal configs nest the language model's
        heads = int(c["num_attention_heads"])
        return cls(
            max_positions=int(c["max_position_embeddings"]) if positions else None,
            n_layers=int(c["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            weights_bytes=weights_bytes,
            source=source,
        )


def _config_file(name: str, cache_dir: str | None) -> Path | None:
    """config.json of a registered model, if it is on this machine (no download, no weights)."""

    spec = get_spec(name)
    if spec.source == "package":
        path = kv_cache(cache_dir) / "models" / spec.name / "config.json"
        return path if path.is_file() else None
    local = getattr(spec, "path", None)
    if local:  # a local checkpoint folder
        path = Path(local) / "config.json"
        return path if path.is_file() else None
    if not spec.hub_id:
        return None
    # deferred: huggingface_hub is heavy and only this path needs it
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(str(spec.hub_id), "config.json")
    return Path(found) if isinstance(found, str) else None


def model_shape(name: str, tiny_family: str | None, cache_dir: str | None) -> ModelShape | None:
    """The shape of the configured model, or None when its config is not on this machine yet."""
    if tiny_family is not None:
        return ModelShape.from_config(tiny_config(tiny_family).to_dict(), f"tiny-{tiny_family}",
                                      positions=False)
    path = _config_file(name, cache_dir)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    weights = sum(p.stat().st_size for p in path.parent.glob("*.safetensors"))
    return ModelShape.from_config(config, str(path), weights)


def position_problem(length: int, model: str, shape: ModelShape, what: str = "task.length",
                     overhead: int = 0) -> str | None:
    """Why a prompt of `length` tokens (the `what` setting) plus `overhead` tokens around it does
    not fit the model's positions, or None."""
    if shape.max_positions is not None and length + overhead > shape.max_positions:
        around = f" plus {overhead} tokens around it" if overhead else ""
        return (f"{what}={length}{around} exceeds the {shape.max_positions} positions of model {model} "
                f"(max_position_embeddings in {shape.source}); use {what} <= {shape.max_positions - overhead}")
    return None


def estimate(n_items: int, length: int, shape: ModelShape | None, dtype_bytes: int) -> dict[str, int]:
    """Bytes by part: items (held and being built), then KV cache, attention scores and weights."""
    parts = {"items": n_items * length * HELD_BYTES_PER_TOKEN + length * BUILD_BYTES_PER_TOKEN}
    if shape is not None:
        per_token = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * dtype_bytes
        parts["kv_cache"] = KV_COPIES * length * per_token
        parts["attention"] = shape.n_heads * length * length * 4
        parts["weights"] = shape.weights_bytes
    return parts


def machine_bytes(device: str) -> tuple[int | None, str]:
    """Memory of the device the forward passes run on (RAM for CPU), and its name."""


    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        index = torch.cuda.current_device() if dev.index is None else dev.index
        return timing.total_bytes(torch.device("cuda", index)), f"GPU {index}"
    return timing.total_bytes("cpu"), "this machine"


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def memory_problem(n_items: int, length: int, shape: ModelShape | None, dtype_bytes: int,
                   device: str) -> str | None:
    parts = estimate(n_items, length, shape, dtype_bytes)
    total = sum(parts.values())
    have, where = machine_bytes(device)
    if have is None or total <= have:
        return None
    detail = ", ".join(f"{k} {human(v)}" for k, v in parts.items() if v)
    return (f"task.length={length} with task.n_items={n_items} needs about {human(total)} of memory "
            f"({detail}) but {where} has {human(have)}; lower task.length or task.n_items")
