"""Wall time and peak memory of a region of work, correct on a GPU as on a CPU.

CUDA kernels run asynchronously: `time.perf_counter()` around a forward measures how long the
launches took, not the work. A timed region therefore synchronises the device before it starts
and before it stops. Peak memory is `torch.cuda.max_memory_allocated` (reset at the start) on
CUDA; on CPU it is the rise of the process' peak resident set (VmHWM, reset through
/proc/self/clear_refs on Linux; NaN where the kernel does not allow the reset).
"""

from __future__ import annotations

import ctypes
import gc
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvnotes.errors import KvnotesError

T = TypeVar("T")
MB = 2**20


def as_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    dev = as_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _status_kb(field_name: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    m = re.search(rf"{field_name}:\s+(\d+)", text)
    return int(m.group(1)) if m else None


def _reset_cpu_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc), so a later peak counts new allocations."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse, as a serving process' allocator does.

    By default glibc returns large freed blocks to the OS (each is its own mapping above a
    threshold that adapts as the process runs), so the next cache of that size is new memory and
    pays one page fault per 4 KiB on first touch. On this project's 2-core CPUs that cost rose
    with whatever the heap did before: a 4k-token transplant's assembly took 33-96 ms from fresh
    buffers and 26 ms from reused ones, a 4k prefill 12.2 s against 10.2 s. With blocks up to
    32 MiB (a layer's keys at 32k tokens on SmolLM2) served from the heap and the heap kept,
    every path reuses memory, like PyTorch's caching allocator on CUDA. The process then keeps its
    peak heap. True if glibc took both settings; False elsewhere (no glibc: nothing changes).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


@dataclass
class Measurement:
    """Filled in when the region ends: wall seconds, the process' CPU seconds (all threads; on a
    shared CPU the steadier measure of work), peak memory rise in MB (NaN: unknown)."""

    device: torch.device
    seconds: float = float("nan")
    cpu_seconds: float = float("nan")
    peak_mb: float = float("nan")


@contextmanager
def timed(device: torch.device | str | None, memory: bool = False) -> Iterator[Measurement]:
    """Time the `with` body, the device synchronised at both ends; `memory`: also its peak.

    The memory reset (gc, malloc_trim, peak reset) happens before the clock starts.
    """
    dev = as_device(device)
    out = Measurement(dev)
    base: int | None = None
    ok = False
    if memory:
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            ok = True
        else:
            _trim()
            ok = _reset_cpu_peak()
            base = _status_kb("VmRSS")
    synchronize(dev)
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        yield out
    finally:
        synchronize(dev)
        out.seconds = time.perf_counter() - t0
        out.cpu_seconds = time.process_time() - c0
        if memory and ok and base is not None:
            if dev.type == "cuda":
                out.peak_mb = (torch.cuda.max_memory_allocated(dev) - base) / MB
            else:
                peak = _status_kb("VmHWM")
                out.peak_mb = float("nan") if peak is None else (peak - base) / 1024


def measure(fn: Callable[[], T], device: torch.device | str | None = None,
            memory: bool = True) -> tuple[T, float, float]:
    """(fn(), seconds, peak memory rise in MB during fn) with the device synchronised."""
    with timed(device, memory) as m:
        result = fn()
    return result, m.seconds, m.peak_mb


_CUDA_CAPS: dict[int, int] = {}  # device index -> bytes, set by set_memory_cap


def _cuda_index(dev: torch.device) -> int:
    return dev.index if dev.index is not None else torch.cuda.current_device()


def set_memory_cap(device: torch.device | str, gib: float) -> int:
    """Make this process behave as on a GPU of `gib` GiB: PyTorch's allocator refuses to hold more
    (set_per_process_memory_fraction) and `available_bytes` counts against the cap. Returns the
    cap in bytes; ValueError for a non-CUDA device or a cap above the device's memory."""
    dev = as_device(device)
    if dev.type != "cuda":
        raise ValueError(f"a memory cap needs a CUDA device, not {dev}")
    total = total_bytes(dev)
    cap = int(gib * 2**30)
    if not 0 < cap <= total:
        raise ValueError(f"memory cap {gib} GiB: the device holds {total / 2**30:.1f} GiB")
    index = _cuda_index(dev)
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    _CUDA_CAPS[index] = cap
    return cap


def available_bytes(device: torch.device | str | None) -> int:
    """Memory free for new tensors: on CUDA the device's free memory plus the blocks PyTorch holds
    unused, within the cap of `set_memory_cap`; MemAvailable on Linux CPUs."""
    dev = as_device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        held_unused = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        cap = _CUDA_CAPS.get(_cuda_index(dev))
        room = int(free) + held_unused
        return room if cap is None else min(room, cap - torch.cuda.memory_allocated(dev))
    kb = _meminfo_kb("MemAvailable")
    return 4 * 2**30 if kb is None else kb * 1024  # 4 GiB where it cannot be read


def total_bytes(device: torch.device | str | None) -> int:
    dev = as_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    kb = _meminfo_kb("MemTotal")
    return 8 * 2**30 if kb is None else kb * 1024


def native_bf16(device: torch.device | str | None) -> bool:
    """Whether the device computes bf16 natively: CUDA with bf16 support, CPUs with AVX512-BF16,
    AMX-BF16 or (aarch64) BF16 instructions. Without them a CPU emulates bf16 matmuls, several
    times slower than fp32 (5.7 vs 26 GFLOPS measured for one thread of an AVX2 CPU)."""
    dev = as_device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if dev.type != "cpu":
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    m = re.search(r"^(flags|Features)\s*:(.*)$", text, re.M)
    flags = set(m.group(2).split()) if m else set()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _meminfo_kb(key: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(rf"^{key}:\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else None


def model_bytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_bytes_per_token(model: Any) -> int:
    """K and V of one token over every layer, in the model's dtype (a kvnotes LoadedModel)."""
    a, hf = model.adapter, model.hf
    return 2 * model.n_layers * a.n_kv_heads(hf) * a.head_dim(hf) * torch.finfo(model.dtype).bits // 8


def estimate_peak_bytes(model: Any, tokens: int, caches: int = 3) -> int:
    """A job's peak: the weights, `caches` KV caches of `tokens`, and one prefill's working set.

    The working set of a prefill chunk: the hidden states and MLP activations of every token
    (about 8 x hidden + 3 x intermediate values each), the logits of one position, and one
    layer's attention scores where the kernel materialises them (q x k fp32 per head, bounded
    here by a flash-style kernel's blocks: 4 x heads x tokens x 256).
    """
    cfg = model.config
    hidden, inter = int(cfg.hidden_size), int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    width = torch.finfo(model.dtype).bits // 8
    act = tokens * (8 * hidden + 3 * inter) * width
    scores = 4 * model.adapter.n_heads(model.hf) * tokens * 256 * 4
    return model_bytes(model.hf) + caches * tokens * kv_bytes_per_token(model) + act + scores + 4 * int(cfg.vocab_size)


class MemoryBudgetError(KvnotesError, RuntimeError):
    """A job that cannot fit in the device's memory; raised before any work."""


def check_fits(model: Any, tokens: int, caches: int = 3, headroom: float = 0.9,
               device: torch.device | str | None = None) -> str:
    """One line with the estimated peak; raises MemoryBudgetError when it exceeds the free memory.

    When the weights are resident on `model.device`, the budget is the free memory plus the
    weights. A model on the meta device (built from its config, nothing allocated) is checked
    against `device`'s free memory before any weights exist.
    """
    dev = model.device if device is None else as_device(device)
    need = estimate_peak_bytes(model, tokens, caches)
    resident = model.device.type != "meta"  # a meta model's weights are not allocated yet
    have = available_bytes(dev) + (model_bytes(model.hf) if resident else 0)
    line = (f"estimated peak memory {need / 2**30:.2f} GiB for {tokens} tokens on {dev} "
            f"({have / 2**30:.2f} GiB available)")
    if need > headroom * have:
        raise MemoryBudgetError(f"{line}: does not fit; use fewer tokens, a smaller dtype or a larger device")
    return line


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` torch CPU threads (None: unchanged); 1 is steadier on a shared CPU."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
