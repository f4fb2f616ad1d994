"""Writing a run directory's files: atomically, never through a symbolic link, one line per fault.

Every file of a run is either replaced whole (a temporary file beside it, then a rename: the
rename replaces a link planted at the name, never its target) or appended through a descriptor
opened with O_NOFOLLOW (command.txt, run.log). A temporary file whose write failed is removed at
once, so a full disk leaves no empty `.tmp` behind. `disk_problem` turns the OSError of a full,
over-quota or read-only file system into the one line a user sees.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvnotes.measure import runfiles

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the disk, not the code: no traceback


class RunDirError(Exception):
    """A run directory that cannot be used: not writable, held by another process, holding a
    link where its own files belong, or (to resume) started at another commit."""


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def atomic_write(path: Path, data: bytes) -> None:
    """`data` to `path` through `.<name>.tmp` and a rename; the temporary file is created fresh
    (O_EXCL, O_NOFOLLOW: a link planted at its name is removed, not written through) and
    removed when the write fails."""
    tmp = tmp_path(path)
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (tmp + rename). NaN is written as NaN, never replaced by a sentinel."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def rewrite_in_place(path: Path, obj: Any) -> None:
    """JSON over an existing file's own blocks (no temporary file): the fallback that can still
    record a status when the disk is full and `write_json` cannot create its temporary file."""
    data = (json.dumps(obj, indent=2, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | NOFOLLOW)
    with os.fdopen(fd, "wb") as f:
        os.ftruncate(fd, 0)
        f.write(data)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def append_text(path: Path, text: str) -> None:
    """Append to `path` (created if missing) without following a link planted at its name."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o644)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(text)


def is_link(path: Path) -> bool:
    return os.path.islink(path)


def remove_tmp(folder: Path) -> list[str]:
    """Remove the `.*.tmp` files directly in `folder` and in its `parts/` (links only unlinked,
    never followed); the names removed."""
    gone = []
    for d in (folder, folder / runfiles.PARTS):
        if is_link(d) or not d.is_dir():
            continue
        for p in d.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    p.unlink()
                    gone.append(p.name)
    return gone


def disk_problem(e: BaseException) -> str | None:
    """The strerror of a full, over-quota or read-only file system ("No space left on device",
    "Read-only file system"), else None."""
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        return e.strerror or os.strerror(int(e.errno or 0))
    return None


class NoFollowFileHandler(logging.FileHandler):
    """A FileHandler that appends without following a link and never prints a logging traceback
    (a full disk must not turn every log line into one: the run's status says what happened)."""

    def _open(self) -> Any:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o644)
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8")

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass
