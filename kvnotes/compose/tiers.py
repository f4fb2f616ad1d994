"""Memory tiers a server keeps stored blocks in, each block verified once, when it enters.

A block read from disk may have changed there, so entering a tier (`MemoryTier.admit`) reads the
file once into one contiguous buffer and checks the content checksum saved with it
(kvnotes.compose.store): a damaged file is refused before any use. Using a block from a tier
(`get`) hashes nothing, so no hash sits on a hot tier's critical path. Damage to a block while
it is held is found by `scrub`, which re-hashes what the tier holds off the critical path (between
requests); a block it finds damaged is dropped and every later `get` of it refused in one line.
Damage after the last scrub is not seen before use: the price of not hashing on every use.

The `device` tier holds the buffer in the model device's memory; the `host` tier in host memory,
pinned on CUDA, and moves a block to the device in one transfer per use. On a CPU the device is
the host: both tiers hold the same kind of buffer and `get` moves nothing (`pinned` is False).
The disk tier is `store.load_block` itself: every read from disk is an entry and is verified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from kvnotes.compose.splice import Block
from kvnotes.compose.store import (
    BlockDamagedError,
    BlockInfo,
    StoreError,
    check_content,
    check_usable,
    read_info,
)
from kvnotes.engine.cache import KVCache
from kvnotes.models.loading import LoadedModel

TIERS = ("device", "host")
ALIGN = 64  # bytes: every tensor of a packed block starts on a cache line


@dataclass(frozen=True)
class _Held:
    """One block in a tier: its bytes in one buffer, where each tensor lies, what it must hash to."""

    buffer: Tensor  # [bytes] uint8
    layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]  # name -> (offset, dtype, shape)
    meta: dict[str, str]
    info: BlockInfo
    path: Path
    block: Block | None  # the views, built once, when the buffer already sits on the model's device


def _pack(tensors: dict[str, Tensor], pin: bool) -> tuple[Tensor, dict[str, tuple[int, torch.dtype, tuple[int, ...]]]]:
    """Every tensor's bytes copied into one host buffer (pinned when asked), aligned."""
    layout, at = {}, 0
    for name, t in tensors.items():
        layout[name] = (at, t.dtype, tuple(t.shape))
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(at, dtype=torch.uint8, pin_memory=pin)
    for name, t in tensors.items():
        lo = layout[name][0]
        buf[lo : lo + t.numel() * t.element_size()].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return buf, layout


def _views(buf: Tensor, layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]) -> dict[str, Tensor]:
    out = {}
    for name, (lo, dtype, shape) in layout.items():
        n = dtype.itemsize * int(torch.Size(shape).numel())
        out[name] = buf[lo : lo + n].view(dtype).view(shape)
    return out


def _block(buf: Tensor, layout: dict[str, tuple[int, torch.dtype, tuple[int, ...]]], info: BlockInfo) -> Block:
    t = _views(buf, layout)
    n = info.n_layers
    return Block(t["ids"], KVCache(tuple(t[f"k.{i}"] for i in range(n)), tuple(t[f"v.{i}"] for i in range(n))))


class MemoryTier:
    """Blocks held in device or host memory (`where`), verified on entry, hashed again only by `scrub`."""

    def __init__(self, model: LoadedModel, where: str) -> None:
        if where not in TIERS:
            raise ValueError(f"tier {where!r}: valid: {', '.join(TIERS)}")
        self.model, self.where = model, where
        cuda = model.device.type == "cuda"
        self.pinned = cuda and where == "host"
        self._held: dict[str, _Held] = {}
        self._damaged: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def admit(self, path: str | os.PathLike[str], name: str | None = None) -> str:
        """Read the block at `path` into this tier and verify it (mismatch and checksum): the one
        hash of its life in the tier. Returns the name it is held under (default: its stored name)."""

        path = Path(path)
        info = read_info(path)
        check_usable(info, self.model, path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                buf, layout = _pack({n: f.get_tensor(n) for n in f.keys()}, self.pinned)
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise StoreError(f"{path}: unreadable safetensors file ({e})") from e
        check_content(info, _views(buf, layout), meta, path)  # the copy the tier will hold
        if self.where == "device" and self.model.device.type != "cpu":
            buf = buf.to(self.model.device)
        key = name or info.name
        on_device = buf.device == self.model.device
        self._held[key] = _Held(buf, layout, meta, info, path, _block(buf, layout, info) if on_device else None)
        self._damaged.pop(key, None)
        return key

    def get(self, name: str) -> Block:
        """The block on the model's device, no hash: views of the tier's buffer, or (host tier
        on CUDA) of one copy of it made in one transfer."""
        held = self._held.get(name)
        if held is None:
            if name in self._damaged:
                raise BlockDamagedError(self._damaged[name])
            raise StoreError(f"block {name!r} is not in the {self.where} tier; admit it first")
        if held.block is not None:
            return held.block
        buf = held.buffer.to(self.model.device, non_blocking=self.pinned)  # one transfer per block
        return _block(buf, held.layout, held.info)

    def scrub(self) -> list[str]:
        """Re-hash every held block (off the critical path); drop the damaged ones, whose later
        `get` is refused in one line. Returns their names."""
        bad = []
        for name, held in list(self._held.items()):
            try:
                check_content(held.info, _views(held.buffer.cpu(), held.layout), held.meta, held.path,
                              where=f"in the {self.where} tier")
            except BlockDamagedError as e:
                self._damaged[name] = str(e)
                del self._held[name]
                bad.append(name)
        return bad
