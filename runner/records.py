"""The records of a run, one unit at a time: parts/<unit>.parquet, each with its sha256 beside it.

A unit (an item, a block) is written to a temporary file and renamed into place, then its
checksum (`parts/<unit>.parquet.sha256`) the same way. A unit counts as done only when its part
hashes to that checksum: a truncated part or a flipped bit is found when the run resumes, logged
in one line and computed again, instead of failing the run at the end (or, worse, entering the
records). A part with no checksum (written by a kvnotes that kept none, or killed between the two
renames) counts when it reads back as parquet, and gets its checksum then. A part that is a
symbolic link was not written by this run: it is unlinked (never followed) and computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from kvnotes.measure import runfiles
from runner.files import RunDirError, atomic_write, is_link

log = logging.getLogger(__name__)
UNIT = "unit"  # column naming the unit a record was written in
SUM = ".sha256"


def unit_filename(key: object) -> str:
    """A safe, unique file stem for a unit key (unsafe characters replaced, hash appended)."""
    text = str(key)
    safe = re.sub(r"[^A-Za-z0-9._=-]", "_", text)[:80]
    if safe.startswith("."):  # a hidden name is a temporary file to the writer, never read as a part
        safe = "_" + safe[1:]
    if safe != text:
        safe = f"{safe}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
    return safe


def _parquet(frame: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


class RecordWriter:
    """Appends the records of one unit at a time as parts/<unit>.parquet, atomically, checksummed."""

    def __init__(self, run_dir: Path) -> None:
        self.parts = run_dir / runfiles.PARTS
        self.records_path = run_dir / runfiles.RECORDS
        if is_link(self.parts):
            raise RunDirError(f"{self.parts} is a symbolic link; a run keeps its parts in its own "
                              "folder: remove the link, or pass resume=false to start a new run")
        self.parts.mkdir(parents=True, exist_ok=True)
        self._checked: set[str] = set()  # parts found intact by this process (they are ours: locked)

    def _path(self, key: object) -> Path:
        return self.parts / f"{unit_filename(key)}.parquet"

    @staticmethod
    def _sum_path(part: Path) -> Path:
        return part.with_name(part.name + SUM)

    def _problem(self, part: Path, data: bytes) -> str | None:
        """Why `data`, read from `part`, is not a unit this run wrote intact, or None."""
        try:
            recorded: str | None = self._sum_path(part).read_text().strip()
        except FileNotFoundError:
            recorded = None
        if recorded is None:  # no checksum yet: it counts if it reads back
            try:
                pd.read_parquet(io.BytesIO(data))
            except Exception as e:  # pyarrow's errors for a damaged file are of several types
                return f"has no checksum and does not read back ({type(e).__name__})"
            atomic_write(self._sum_path(part), hashlib.sha256(data).hexdigest().encode())
            return None
        if hashlib.sha256(data).hexdigest() != recorded:
            return f"does not match its checksum ({len(data)} bytes; damaged after it was written)"
        return None

    def _discard(self, part: Path, problem: str) -> None:
        log.warning("part %s %s: computing it again", part, problem)
        for p in (part, self._sum_path(part)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # a link itself, never its target

    def _read(self, part: Path) -> bytes | None:
        """The bytes of an intact part; None (the part removed, one warning) for a link or a
        damaged one."""
        if is_link(part):
            self._discard(part, "is a symbolic link, not a part this run wrote")
            return None
        data = part.read_bytes()
        problem = self._problem(part, data)
        if problem:
            self._discard(part, problem)
            return None
        return data

    def _intact(self, part: Path) -> bool:
        if part.name in self._checked:
            return True
        if not (is_link(part) or part.is_file()) or self._read(part) is None:
            return False
        self._checked.add(part.name)
        return True

    def done(self, key: object) -> bool:
        """Whether this unit is on disk and intact (a rerun skips it); a damaged one is removed."""
        return self._intact(self._path(key))

    def write(self, key: object, records: Iterable[Mapping[str, Any]]) -> None:
        """All records of unit `key` (possibly none: the unit still counts as done)."""
        rows = [dict(r) for r in records]
        if any(UNIT in r for r in rows):
            raise ValueError(f"records may not carry a {UNIT!r} column; it names the unit")
        frame = pd.DataFrame(rows)
        frame.insert(0, UNIT, str(key))
        data = _parquet(frame)
        path = self._path(key)
        atomic_write(path, data)
        atomic_write(self._sum_path(path), hashlib.sha256(data).hexdigest().encode())
        self._checked.add(path.name)

    def _units(self) -> list[Path]:
        return sorted(p for p in self.parts.glob("*.parquet") if not p.name.startswith("."))

    def n_done(self) -> int:
        return sum(self._intact(p) for p in self._units())

    def read(self) -> pd.DataFrame:
        """Every unit written so far, concatenated in unit-file order. Each part is checked as it
        is read: a link is dropped; a damaged part is removed and stops the read (rerun to redo it)."""
        frames = []
        for p in self._units():
            linked = is_link(p)
            data = self._read(p)
            if data is None and not linked:
                self._checked.discard(p.name)
                raise RunDirError(f"part {p} was damaged after it was written; rerun the same "
                                  "command to compute it again")
            if data is not None:
                frames.append(pd.read_parquet(io.BytesIO(data)))
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({UNIT: []})

    def finalize(self) -> pd.DataFrame:
        """Concatenate the parts into records.parquet (atomically); the parts stay until cleanup."""
        frame = self.read()
        atomic_write(self.records_path, _parquet(frame))
        return frame

    def cleanup(self) -> None:
        """Drop the parts once the run is completed (records.parquet holds them all).

        Never raises and never follows a link: a `parts` that is a link is left alone, a link
        inside it is unlinked, not its target. A leftover file (a `.tmp` of a killed attempt) or
        a part another tool holds open is logged and left, since the run itself is complete.
        """
        if is_link(self.parts) or not self.parts.is_dir():
            if is_link(self.parts):
                log.warning("left %s in place: it is a symbolic link", self.parts)
            return
        for p in self.parts.iterdir():
            if p.name.endswith((".parquet", ".tmp", ".parquet" + SUM)) and (is_link(p) or p.is_file()):
                with contextlib.suppress(OSError):
                    p.unlink()
        try:
            self.parts.rmdir()
        except OSError as e:
            log.warning("left %s in place: %s", self.parts, e.strerror or e)
