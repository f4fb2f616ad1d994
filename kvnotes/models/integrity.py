"""Integrity of a weights folder: a record written once, a cheap check on every load, a full one on demand.

When a folder is written (a conversion, a tokenizer extraction), every file in it is recorded:
its size, its sha256 and, for a safetensors file, the sha256 of its header (the 8-byte length
and the JSON table of tensor names, dtypes, shapes and byte offsets). Every load re-checks the
sizes, the headers and the full hash of each small file, which costs milliseconds at any model
size; `python -m kvnotes.models verify NAME` (and fetch) re-hashes every byte. The cheap check
catches a missing, truncated or extended file and any damage to a header; it cannot see bytes
changed inside a tensor's data without a change of size. Those the full hash catches, and the
finite-logits check at load catches the ones that give NaN or inf.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvnotes.measure.digests import file_sha256

HEADER_MAX = 100 << 20  # safetensors refuses larger headers too
SMALL = 64 << 20  # files below this size are hashed in full on every load
WEIGHTS_SUFFIX = ".safetensors"


sha256_file = file_sha256  # the one file hash (kvnotes.measure.digests), under the name the weights code reads


def safetensors_header(path: Path) -> bytes:
    """The 8-byte length and JSON header of a safetensors file; ValueError when it is damaged.

    Beyond parsing, the tensors' byte ranges must end exactly where the file ends, so a
    truncated or extended file is refused here even without a recorded size.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, HEADER_MAX):
            raise ValueError(f"header length {n} does not fit in the file's {size} bytes")
        body = f.read(n)
    try:
        table = json.loads(body)
        end = max((int(v["data_offsets"][1]) for k, v in table.items() if k != "__metadata__"),
                  default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"damaged header ({type(e).__name__}: {e})") from None
    if 8 + n + end != size:
        raise ValueError(f"the header places tensor data up to byte {8 + n + end}, the file has {size}")
    return head + body


def record_file(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file, plus its header's sha256 when it is a safetensors file."""
    rec: dict[str, Any] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    if path.name.endswith(WEIGHTS_SUFFIX):
        rec["header_sha256"] = hashlib.sha256(safetensors_header(path)).hexdigest()
    return rec


def record_folder(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """`record_file` of every regular file directly in `folder`, except hidden (temporary) files
    and those named in `skip`."""
    return {p.name: record_file(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in skip and not p.name.startswith(".")}


def check_file(path: Path, rec: Mapping[str, Any], full: bool) -> str | None:
    """What is wrong with `path` against its record (None: nothing found at this level)."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != rec["size"]:
        return f"{path.name} has {size} bytes, {rec['size']} when written (truncated or overwritten)"
    if "header_sha256" in rec:
        try:
            header = safetensors_header(path)
        except ValueError as e:
            return f"{path.name}: {e}"
        if hashlib.sha256(header).hexdigest() != rec["header_sha256"]:
            return f"{path.name}: its header differs from the one written (damaged header)"
    if (full or size < SMALL) and sha256_file(path) != rec["sha256"]:
        return f"{path.name}: sha256 differs from the one recorded when it was written"
    return None


def check_folder(folder: Path, files: Mapping[str, Mapping[str, Any]], full: bool) -> list[str]:
    """Every problem found in `folder` against its record; empty when all files pass."""
    return [p for name, rec in files.items() if (p := check_file(folder / name, rec, full))]


def weights_digest(files: Mapping[str, str]) -> str:
    """One sha256 for the weights files: the file's own sha256 when there is one file, else the
    sha256 of their `name sha256` lines (sorted), so a single-file model checks with sha256sum."""
    if len(files) == 1:
        return next(iter(files.values()))
    lines = "".join(f"{n} {s}\n" for n, s in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


@dataclass(frozen=True)
class WeightsCheck:
    """What was verified of a weights folder just before it was loaded.

    `level` is `sha256` (every byte re-hashed now), `size+header` (sizes, safetensors headers
    and small files re-checked; tensor data trusted to the record), or `recorded-now` (a folder
    written before kvnotes kept checksums: they were recorded at this load, nothing compared).
    """

    path: Path
    level: str
    files: dict[str, str]  # weights file -> sha256 (the recorded one, re-hashed at level sha256)
    source_sha256: str | None = None  # the GGUF's sha256, checked against the pin when converting
    recorded: str = "conversion"

    @property
    def digest(self) -> str | None:
        return weights_digest(self.files) if self.files else None

    @property
    def digest_source(self) -> str | None:
        """Where `digest` comes from: hashed from the bytes just loaded, or the conversion's
        record, trusted because the sizes and headers match it (tensor data not re-read)."""
        if not self.files:
            return None
        if self.level == "size+header":
            return f"recorded at {self.recorded}, not re-hashed at this load"
        return "re-hashed at this load" if self.level == "sha256" else "hashed at this load (first record)"

    def provenance(self) -> dict[str, Any]:
        return {
            "weights_sha256": self.digest,
            "weights_sha256_source": self.digest_source,
            "weights_verified": self.level,
            "weights_files": dict(self.files),
            "checksums_recorded": self.recorded,
            "gguf_sha256": self.source_sha256,
        }
