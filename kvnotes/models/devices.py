"""Which device and dtype a model runs in: names and torch dtypes checked, `auto` resolved, and a
device this machine lacks refused in one line before any weights are read."""

from __future__ import annotations

import logging
import re

import torch

from kvnotes.errors import ConfigError
from kvnotes.measure import timing
from kvnotes.models.registry import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def one_line(e: BaseException) -> str:
    """An exception's message on one line (the `error:` line a user sees)."""
    return " ".join(str(e).split())


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU; anything else is passed to torch.device.

    A device this machine lacks (`cuda` without CUDA, `mps` without MPS) is a `ConfigError`
    naming what is there, before any weights are read, not torch's error at the first copy."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"unknown device {device!r}; valid: auto, cpu, cuda, cuda:N, mps ({one_line(e)})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r} asked for, but CUDA is not available here "
                              f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                              f"use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {str(device)!r} asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); use cuda:0.."
                              f"{torch.cuda.device_count() - 1} or 'auto'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {str(device)!r} asked for, but MPS is not available here; use "
                          f"device='cpu' or 'auto'")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype | None, spec: ModelSpec | None = None,
    device: torch.device | str | None = None,
) -> torch.dtype:
    """The torch dtype for a name or a torch dtype (float32, bfloat16, float16); `auto` picks the fastest exact-enough dtype for the device.

    auto: bf16 on a GPU that computes it natively (else fp32). On a CPU, fp32 when the fp32
    weights fit in half the free memory, except bf16 when the model is declared fine in bf16
    (its spec's default) and the CPU has native bf16 (AVX512-BF16/AMX), where bf16 matmuls are
    faster; a CPU without native bf16 emulates it, several times slower than fp32 (5.7 vs 26
    GFLOPS measured), so bf16 there only when fp32 does not fit. The choice and its reason are
    logged (logger kvnotes.models.devices).
    """
    if dtype not in (None, "auto"):  # a name, "torch.float16", or torch.float16 itself
        name = str(dtype).removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
        raise ConfigError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)} "
                          f"(as strings or torch dtypes, e.g. torch.bfloat16)")
    dev = resolve_device("auto") if device is None else torch.device(device)
    declared = spec.default_dtype if spec else "float32"
    params: float | None = None  # from the packaged GGUF (about 4.5 bits a weight) or the name
    if spec is not None and spec.size_bytes:
        params = spec.size_bytes * 8 / 4.5
    elif spec is not None and (m := re.search(r"(\d+(?:\.\d+)?)[bB]\b", spec.name)):
        params = float(m.group(1)) * 1e9
    if dev.type == "cuda":
        pick = "bfloat16" if timing.native_bf16(dev) else "float32"
        why = "CUDA with native bf16" if pick == "bfloat16" else "this GPU lacks bf16"
    elif dev.type != "cpu":
        pick, why = "float32", f"{dev.type}: fp32"
    else:
        fits = params is None or 4 * params < 0.5 * timing.available_bytes(dev)
        fast_bf16 = timing.native_bf16(dev)
        if fits and not (declared == "bfloat16" and fast_bf16):
            pick = "float32"
            why = ("CPU without native bf16 (bf16 would be emulated, slower)" if not fast_bf16
                   else "the model's declared dtype is fp32") + "; fp32 weights fit in memory"
        else:
            pick = "bfloat16"
            why = ("native bf16 CPU and the model is declared fine in bf16" if fits
                   else "fp32 weights would not fit in half the free memory")
    logging.getLogger(__name__).info("dtype=auto on %s: %s (%s)", dev, pick, why)
    return DTYPES[pick]
