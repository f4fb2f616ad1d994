"""The skill store: precompiled blocks on disk, loadable by another process, refused by another model.

A block prefilled alone at positions 0..L-1 is saved as one safetensors file: `k.<layer>` and
`v.<layer>` ([1, kv_head, L, d_head], post-RoPE keys, in the model's dtype) and `ids` ([1, L]),
with metadata naming the model, the weights it was prefilled under, its rotary configuration,
the dtype and a checksum of the content (every tensor's bytes and the other metadata). K/V are only
meaningful under the exact weights and rotary frequencies that wrote them, so loading checks all
three and refuses a mismatch with the differing fields; the weights are identified by what was
loaded (the digest of the converted files, a hub commit, or a fingerprint of the parameters),
not by a registry pin. Loading re-hashes the content, so a flipped byte in K/V or ids is refused
rather than spliced; tensors are mapped from the file (safetensors mmap), read once by that hash.
The checksum is XXH3-128 (format /3): it guards against damage, not tampering, and costs about
0.01 s per 184 MB here where sha256 took 0.14 s, which was most of a 4k-token transplant's
overhead over its limit. Blocks of format /2 (sha256) still load and are checked with sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvnotes.compose.splice import Block
from kvnotes.engine.cache import KVCache
from kvnotes.errors import KvnotesError
from kvnotes.models.loading import LoadedModel, weights_id

FORMAT = "kvnotes-block/3"  # /1 had no content checksum; /2 a sha256 (still read)
READABLE = ("kvnotes-block/2", FORMAT)
CHECKSUM = "xxh3_128"
SUFFIX = ".safetensors"


class StoreError(KvnotesError, ValueError):
    """A stored block that cannot be used here (unreadable, or made by another model)."""


class BlockMismatchError(StoreError):
    """The block was prefilled by another model, rotary configuration or dtype."""


class BlockDamagedError(StoreError):
    """The block's content differs from what was saved (its checksum does not match)."""


def rope_signature(model: LoadedModel) -> str:
    """JSON of what fixes the keys' rotation: per-layer rope parameters, head and layer counts."""
    hf, a = model.hf, model.adapter
    layers = [a.rope_parameters(hf, i) for i in range(model.n_layers)]
    sig = {
        "family": a.family,
        "head_dim": a.head_dim(hf),
        "n_kv_heads": a.n_kv_heads(hf),
        "n_layers": model.n_layers,
        "rope": layers if any(p != layers[0] for p in layers) else layers[0],
    }
    return json.dumps(sig, sort_keys=True, default=str)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BlockInfo:
    """The metadata of a stored block (what `save_block` writes beside the tensors)."""

    name: str
    model: str
    weights: str
    rope: str
    dtype: str
    length: int
    n_layers: int
    format: str = FORMAT
    text: str = ""
    checksum: str = ""  # "<algorithm>:<hex>" of the content: `content_checksum(tensors, meta, algorithm)`

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str], path: Path) -> BlockInfo:
        if meta.get("format") == "kvnotes-block/1":
            raise StoreError(f"{path}: block written by an older kvnotes (kvnotes-block/1, no "
                             f"content checksum); save it again")
        if meta.get("format") not in READABLE:
            raise StoreError(f"{path}: not a kvnotes block (format {meta.get('format')!r}, "
                             f"expected {FORMAT!r})")
        try:
            checksum = meta["checksum"] if meta["format"] == FORMAT else "sha256:" + meta["sha256"]
            return cls(meta["name"], meta["model"], meta["weights"], meta["rope"], meta["dtype"],
                       int(meta["length"]), int(meta["n_layers"]), meta["format"],
                       meta.get("text", ""), checksum)
        except KeyError as e:
            raise StoreError(f"{path}: block metadata lacks {e.args[0]!r}") from None
        except ValueError as e:
            raise StoreError(f"{path}: damaged block metadata ({e})") from None

    def to_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.__dict__.items()}

    def mismatches(self, model: LoadedModel) -> list[str]:
        """What differs between the model that wrote this block and `model` (empty: usable)."""
        out = []
        if self.model != model.name:
            out.append(f"model: block {self.model!r}, loaded {model.name!r}")
        here = weights_id(model)
        if self.weights != here:
            out.append(f"weights: block {self.weights[:24]}..., loaded {here[:24]}...")
        rope = rope_signature(model)
        if self.rope != rope:
            out.append(f"rope: block {self.rope}, loaded {rope}")
        if self.dtype != dtype_name(model.dtype):
            out.append(f"dtype: block {self.dtype}, loaded {dtype_name(model.dtype)}")
        return out


def content_checksum(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str],
                     algorithm: str = CHECKSUM) -> str:
    """`<algorithm>:<hex>` of every tensor (name, dtype, shape, raw bytes; sorted by name) and the
    metadata (its checksum fields left out); `algorithm` is xxh3_128 or sha256 (format /2)."""

    if algorithm not in ("xxh3_128", "sha256"):
        raise StoreError(f"unknown block checksum algorithm {algorithm!r}")
    h: Any = xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()
    for key in sorted(meta):
        if key not in ("sha256", "checksum"):
            h.update(f"{key}={meta[key]}\0".encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{dtype_name(t.dtype)}:{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # raw bytes, any dtype (bf16 too)
    return f"{algorithm}:{h.hexdigest()}"


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def read_staged(path: str | os.PathLike[str], device: torch.device | str,
                pin: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
    """(host tensors, metadata, the same tensors on `device`) of a safetensors file.

    The tensor bytes are read with one sequential read into one host buffer (pinned on CUDA
    unless `pin` says otherwise), then copied to `device` in one non-blocking transfer. The host
    tensors are views of that buffer, so hashing them overlaps the copy, and no page of a
    memory-mapped file is faulted in one at a time (the mmap path touches 4 KiB pages; a 1 GiB
    block is 262,144 of them).
    """
    dev = torch.device(device)
    pin = dev.type == "cuda" if pin is None else pin
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size - 8 - n
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        view, got = host.numpy().data, 0  # a memoryview of the buffer
        while got < size and (k := f.readinto(view[got:])):
            got += k
    if got != size:
        raise StoreError(f"{path}: {got} of {size} data bytes read")
    meta = header.pop("__metadata__", None) or {}
    placed = host.to(dev, non_blocking=True) if dev != host.device else host

    def views(buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, e in header.items():
            lo, hi = e["data_offsets"]
            dtype = SAFETENSORS_DTYPES[e["dtype"]]
            raw = buf[lo:hi] if lo % dtype.itemsize == 0 else buf[lo:hi].clone()  # aligned: a view
            out[name] = raw.view(dtype).view(e["shape"])
        return out

    on_host = views(host)
    return on_host, meta, on_host if placed is host else views(placed)


NAME_MAX = 200  # characters of a block's file stem on disk (file systems allow 255 bytes a name)


def _escaped(c: str, first: bool) -> str:
    if c.isascii() and (c.isalnum() or c in "_-" or (c == "." and not first)):
        return c
    return "".join(f"~{b:02x}" for b in c.encode())


def block_path(root: str | os.PathLike[str], name: str) -> Path:
    """Where block `name` lives under a store directory.

    A name of ASCII letters, digits, `_`, `-` and `.` (not first) is its own file stem; any
    other character, a leading `.` and `~` itself are written `~XX` per UTF-8 byte ("a/b" ->
    "a~2fb"). So two names never share a file ("a/b" and "a_b" used to), and no name reaches
    outside the store or hides its file. Raises StoreError for an empty or too long name.
    """
    if not name:
        raise StoreError("a block name must not be empty")
    stem = "".join(_escaped(c, i == 0) for i, c in enumerate(name))
    if len(stem) > NAME_MAX:
        raise StoreError(f"block name {name[:40]!r}... is too long: {len(stem)} characters on disk "
                         f"(escapes included), at most {NAME_MAX}")
    return Path(root) / f"{stem}{SUFFIX}"


def save_block(
    path: str | os.PathLike[str], model: LoadedModel, block: Block, name: str = "", text: str = ""
) -> Path:
    """Write `block` (prefilled alone by `model`) to `path` atomically; returns the path."""

    if block.cache.batch != 1:
        raise ValueError("a stored block is a single sequence (batch 1)")
    if block.cache.n_layers != model.n_layers:
        raise ValueError(f"block has {block.cache.n_layers} layers, the model {model.n_layers}")
    path = Path(path)
    tensors = {"ids": block.ids.detach().to("cpu", torch.long).contiguous()}
    for i, (k, v) in enumerate(zip(block.cache.keys, block.cache.values)):
        tensors[f"k.{i}"] = k.detach().cpu().contiguous()  # [1, kv_head, L, d_head]
        tensors[f"v.{i}"] = v.detach().cpu().contiguous()
    info = BlockInfo(name or path.stem, model.name, weights_id(model), rope_signature(model),
                     dtype_name(block.cache.dtype), len(block), block.cache.n_layers, text=text)
    if info.dtype != dtype_name(model.dtype):
        raise ValueError(f"block dtype {info.dtype} differs from the model's {dtype_name(model.dtype)}")
    meta = info.to_metadata()
    meta["checksum"] = content_checksum(tensors, meta)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a read-only or full store: one line, no .tmp left
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        raise StoreError(f"cannot write block {info.name!r} to {path}: {why}") from None
    return path


def read_info(path: str | os.PathLike[str]) -> BlockInfo:
    """The metadata of a stored block, without touching its tensors."""

    path = Path(path)
    if not path.is_file():
        raise StoreError(f"no stored block at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise StoreError(f"{path}: unreadable safetensors file ({e})") from e
    return BlockInfo.from_metadata(meta, path)


def check_usable(info: BlockInfo, model: LoadedModel, path: Path) -> None:
    """BlockMismatchError listing every field (model, weights, rope, dtype) that differs."""
    bad = info.mismatches(model)
    if bad:
        raise BlockMismatchError(
            f"stored block {info.name!r} ({path}) was prefilled under another configuration and "
            f"cannot be spliced into this model: " + "; ".join(bad)
        )


def check_content(info: BlockInfo, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str],
                  path: Path | str, where: str = "") -> None:
    """BlockDamagedError when `tensors` and `meta` no longer hash to the checksum saved with them
    (`where`: the copy checked, e.g. "in the host tier"; empty: the file)."""
    algorithm = info.checksum.partition(":")[0]
    if (got := content_checksum(tensors, meta, algorithm)) != info.checksum:
        raise BlockDamagedError(
            f"stored block {info.name!r} ({path}){' ' + where if where else ''} is damaged: its "
            f"content hashes to {got[:24]}..., saved as {info.checksum[:24]}... (a changed byte "
            f"in K/V, ids or metadata); {'admit it again' if where else 'save it again'}"
        )


def load_block(
    path: str | os.PathLike[str], model: LoadedModel, device: torch.device | str | None = None,
    verify: bool = True,
) -> Block:
    """The block stored at `path`, checked against `model`; tensors stay memory-mapped on CPU.

    Raises `BlockMismatchError` listing every field (model, weights, rope, dtype) that differs,
    and `BlockDamagedError` when the content no longer hashes to the checksum saved with it
    (`verify=False` skips that hash, which reads every byte once).
    `device` other than CPU copies the tensors there; by default they stay on CPU (zero-copy) and
    `compose.transplant` moves them while rotating. On CUDA the file is read once into pinned
    memory and copied to the device in one transfer that overlaps the hash (`read_staged`).
    """

    path = Path(path)
    info = read_info(path)
    check_usable(info, model, path)
    dev = torch.device("cpu" if device is None else device)
    try:
        if dev.type == "cuda":
            tensors, meta, placed = read_staged(path, dev)
        else:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            placed = tensors
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise StoreError(f"{path}: unreadable safetensors file ({e})") from e
    if verify:
        check_content(info, tensors, meta, path)
    try:
        ids = tensors["ids"]
        keys = tuple(placed[f"k.{i}"] for i in range(info.n_layers))
        values = tuple(placed[f"v.{i}"] for i in range(info.n_layers))
    except KeyError as e:
        raise StoreError(f"{path}: stored block lacks tensor {e.args[0]!r}") from None
    cache = KVCache(keys, values)
    if dev.type not in ("cpu", "cuda"):
        cache = cache.to(device=dev)
    if int(ids.shape[1]) != info.length or cache.seq_len != info.length:
        raise StoreError(f"{path}: length {info.length} in metadata, tensors hold {cache.seq_len}")
    return Block(ids, cache)
