"""Digests of a finished run's files: the bytes the run wrote, so a later edit shows.

When a run completes, its meta.json records `digests`: the sha256 of config.yaml, records.parquet
and summary.json as written, and of meta.json itself as canonical JSON (sorted keys, compact)
less the `digests` and `reference` keys, so the record can sit inside the file it covers and a
copy marked by the reference set still checks. A reader that finds a file whose sha256 differs
knows the run's numbers are no longer the ones it measured. Pure helpers: nothing here writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvnotes.measure import runfiles

DIGESTED = (runfiles.CONFIG, runfiles.RECORDS, runfiles.SUMMARY)  # hashed byte for byte
META = runfiles.META  # hashed as canonical JSON, less UNSEALED
UNSEALED = ("digests", "reference")  # the record itself, and the reference set's mark on a copy
CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def meta_sha256(meta: Mapping[str, Any]) -> str:
    """sha256 of meta.json's content less UNSEALED, as canonical JSON (what a JSON round trip keeps)."""
    plain = json.loads(json.dumps({k: v for k, v in meta.items() if k not in UNSEALED}, default=str))
    blob = json.dumps(plain, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_digests(path: Path, meta: Mapping[str, Any], names: Iterable[str] = DIGESTED) -> dict[str, str]:
    """The digests of run dir `path` whose meta.json will hold `meta`: each of `names`, then meta."""
    return {**{n: file_sha256(Path(path) / n) for n in names}, META: meta_sha256(meta)}


def recorded(meta: Mapping[str, Any]) -> dict[str, str] | None:
    """The digests meta.json records, or None when it records none (or not every file)."""
    d = meta.get("digests")
    if not isinstance(d, dict) or not all(isinstance(d.get(n), str) for n in (*DIGESTED, META)):
        return None
    return {str(k): str(v) for k, v in d.items()}


def changed(path: Path, meta: Mapping[str, Any]) -> list[str]:
    """The files of run dir `path` (meta.json's content: `meta`) that differ from their recorded
    digest; empty when all match or when none is recorded (ask `recorded` which)."""
    d = recorded(meta)
    if d is None:
        return []
    out = [n for n in DIGESTED if not (Path(path) / n).is_file() or file_sha256(Path(path) / n) != d[n]]
    return out + ([META] if meta_sha256(meta) != d[META] else [])
