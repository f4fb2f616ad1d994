"""Run directories: provenance, one lock around finding or making one, attempts, summaries.

A run lives in <results_dir>/<probe-or-experiment>/<model>/<timestamp>/ with config.yaml,
meta.json (provenance, timing, status, one entry per attempt), parts/<unit>.parquet while it runs
(runner/records.py), then records.parquet and summary.json. A rerun with the same config hash
continues in the newest unfinished directory and skips the units already there. Looking for that
directory and making a new one happen under one lock (`<results>/<job>/.<model>.open.lock`), so
two identical runs started at once never both run: the second finds the first's directory held
and is refused. A directory holding a link where its own files belong is refused too. A run is
clean only if every attempt ran from a clean tree: each attempt keeps its commit and dirty flag,
and the top level (`dirty`, `git.dirty`) is true when any attempt's was. A completed run records
the sha256 of its files in meta.json (`digests`), so an edit after the end shows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from kvnotes.measure import runfiles
from kvnotes.measure.digests import run_digests
from runner.files import (
    RunDirError,
    atomic_write,
    disk_problem,
    is_link,
    now_iso,
    read_json,
    rewrite_in_place,
    write_json,
)
from runner.records import UNIT as UNIT
from runner.records import RecordWriter as RecordWriter
from runner.records import unit_filename as unit_filename
from runner.table import summary_table as summary_table

log = logging.getLogger(__name__)
NOT_HASHED = ("resume", "results_dir", "cache_dir", "progress", "threads",  # do not change results
              "verify_weights")
OPEN_LOCK = ".{model}.open.lock"  # beside <results>/<job>/<model>/, which holds run dirs only
OPEN_WAIT_S = 60.0  # another opener holds it for milliseconds; a minute means something is stuck
RUN_FILES = runfiles.ALL


def config_hash(cfg: DictConfig, device: str) -> str:
    """sha256 (12 hex) of the resolved config minus the keys that cannot change a result."""
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    data = {k: v for k, v in data.items() if k not in NOT_HASHED and k != "hydra"}
    data["_device"] = device
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def make_parent(parent: Path) -> None:
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run directory under {parent}: {e.strerror or e}") from None


def new_dir(parent: Path) -> Path:
    """parent/<timestamp>, with a -1, -2, ... suffix if that second is already taken."""
    make_parent(parent)
    base = _stamp()
    for i in range(1000):
        path = parent / (base if i == 0 else f"{base}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise RunDirError(f"cannot create the run directory {path}: {e.strerror or e}") from None
    raise RuntimeError(f"cannot create a run directory under {parent}")


@contextmanager
def open_lock(parent: Path) -> Iterator[None]:
    """Held while an opener looks for an unfinished run under `parent` and takes it, or makes a
    new one: the next opener then finds that run (held) instead of making a second one."""

    make_parent(parent)
    path = parent.parent / OPEN_LOCK.format(model=parent.name)
    if is_link(path):
        raise RunDirError(f"{path} is a symbolic link; remove it")
    lock = FileLock(str(path), timeout=OPEN_WAIT_S)
    try:
        lock.acquire()
    except Timeout:
        raise RunDirError(f"{path} has been held for {OPEN_WAIT_S:.0f} s by another opener; if no run is "
                          "starting under it, delete it") from None
    except OSError as e:
        raise RunDirError(f"cannot lock {path}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def _status(path: Path, chash: str) -> str | None:
    """The status in path/meta.json when its config hash is `chash`, else None."""
    try:
        m = read_json(path / runfiles.META)
    except (OSError, json.JSONDecodeError):
        return None
    return str(m.get("status")) if m.get("config_hash") == chash else None


def find_unfinished(parent: Path, chash: str) -> Path | None:
    """The newest run under `parent` with this config hash whose status is not completed."""
    if not parent.is_dir():
        return None
    for path in sorted((p for p in parent.iterdir() if p.is_dir() and not is_link(p)), reverse=True):
        status = _status(path, chash)
        if status is not None and status != "completed":
            return path
    return None


def link_problem(path: Path) -> str | None:
    """Why run dir `path` must not be resumed: a link where one of its own files belongs (written
    through, it would change another file; followed by cleanup, it would delete one)."""
    for name in RUN_FILES:
        if is_link(path / name):
            return (f"{path / name} is a symbolic link; a run dir holds its own files: remove the link, "
                    "or pass resume=false to start a new run")
    return None


def commit_problem(found: Path, old: Mapping[str, Any], meta: Mapping[str, Any]) -> str | None:
    """Why the unfinished run `found` (its meta.json: `old`) must not be resumed by code at
    another commit (this run's `meta`), or None: its units would mix two versions of the code
    under one run, which no reader can take apart (analysis.reference refuses such runs)."""
    now = (meta.get("git") or {}).get("commit")
    then = {str(a["git_commit"]) for a in old.get("attempts") or [] if isinstance(a, dict) and a.get("git_commit")}
    then |= {c for c in [(old.get("git") or {}).get("commit")] if c}
    if not now or not then or then == {now}:
        return None
    return (f"{found} was started at commit {', '.join(sorted(c[:7] for c in then))}, this code is at "
            f"{str(now)[:7]}: check that commit out to resume it, or pass resume=false to start a new run")


def run_dirty(attempts: Iterable[Mapping[str, Any]]) -> bool | None:
    """True when any attempt ran from a dirty tree, False when every one is recorded clean, None
    when some attempt's tree is unknown (no git, or written before attempts kept the flag)."""
    flags = [a.get("dirty") for a in attempts]
    if any(f is True for f in flags):
        return True
    return False if flags and all(f is False for f in flags) else None


def dead(attempt: Mapping[str, Any]) -> dict[str, Any]:
    """An earlier attempt as a resume finds it: one still `running` (its lock is free, so its
    process is gone: SIGKILL, out of memory, a lost machine) did not end as it claims, and says so."""
    a = dict(attempt)
    if a.get("status") == "running":
        a["status"] = "died"
        a["note"] = "found running when the run was resumed: its process ended without recording a status"
    return a


class RunLock:
    """An exclusive lock on a run directory (filelock: flock, freed by the OS if the holder dies).

    The holder writes its pid, host and start time to `.holder.json` beside the lock, so a
    second process that finds the directory taken can say by whom.
    """

    LOCK = runfiles.LOCK
    HOLDER = runfiles.HOLDER

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = FileLock(str(path / self.LOCK))

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""

        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            return False
        except OSError as e:
            raise RunDirError(f"cannot lock {self.path}: {e.strerror or e}") from None
        write_json(self.path / self.HOLDER, {"pid": os.getpid(), "host": socket.gethostname(),
                                             "since": now_iso()})
        return True

    def holder(self) -> str:
        try:
            h = read_json(self.path / self.HOLDER)
            return f"pid {h.get('pid')} on {h.get('host')} (since {h.get('since')})"
        except (OSError, json.JSONDecodeError):
            return "another process"

    def release(self) -> None:
        if self._lock.is_locked:
            (self.path / self.HOLDER).unlink(missing_ok=True)
            self._lock.release()


@dataclass
class RunDir:
    """A run directory and its meta.json, which tracks status across attempts."""

    path: Path
    meta: dict[str, Any]
    lock: RunLock | None = None
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def open(
        cls, results_dir: Path, job: str, model: str, cfg: DictConfig, chash: str, resume: bool,
        meta: Mapping[str, Any], attempt: Mapping[str, Any] | None = None,
    ) -> RunDir:
        """Resume the newest unfinished run with hash `chash` (if `resume`), else start one.

        The search and the start happen under `open_lock`, so of two identical runs started at
        once one runs and the other is refused. The directory is locked for as long as this
        RunDir is open (`close`). An unfinished run that another process holds is refused
        (RunDirError naming the holder) rather than shared; one that completed between the
        search and the lock is left alone.
        """
        parent = Path(results_dir) / job / model
        try:
            with open_lock(parent):
                run = cls._resume(parent, chash, meta) if resume else None
                if run is None:
                    run = cls._start(parent, cfg, chash, meta)
                run._begin_attempt(meta, attempt)
        except OSError as e:  # a full or read-only disk while writing meta.json or config.yaml
            raise RunDirError(f"cannot start a run under {parent}: {e.strerror or e}") from None
        return run

    @classmethod
    def _resume(cls, parent: Path, chash: str, meta: Mapping[str, Any]) -> RunDir | None:
        while True:
            found = find_unfinished(parent, chash)
            if found is None:
                return None
            problem = link_problem(found)
            if problem:
                raise RunDirError(problem)
            lock = RunLock(found)
            if not lock.acquire():
                raise RunDirError(f"{found} is in use by {lock.holder()}: wait for it to finish, or "
                                  "pass resume=false to start a separate run")
            if _status(found, chash) == "completed":  # finished while we looked: never rewrite it
                lock.release()
                continue
            old = read_json(found / runfiles.META)
            problem = commit_problem(found, old, meta)
            if problem:
                lock.release()
                raise RunDirError(problem)
            attempts = [dead(a) for a in old.get("attempts") or []]
            if attempts and "dirty" not in attempts[-1]:  # written before attempts kept the flag:
                attempts[-1]["dirty"] = (old.get("git") or {}).get("dirty")  # the top level was its
            return cls(found, {**old, **meta, "start_time": old.get("start_time"), "attempts": attempts}, lock)

    @classmethod
    def _start(cls, parent: Path, cfg: DictConfig, chash: str, meta: Mapping[str, Any]) -> RunDir:
        path = new_dir(parent)
        lock = RunLock(path)
        if not lock.acquire():  # nobody else knows this directory yet
            raise RunDirError(f"{path} is in use by {lock.holder()}")
        atomic_write(path / runfiles.CONFIG, OmegaConf.to_yaml(cfg, resolve=True).encode())
        return cls(path, {**meta, "config_hash": chash, "start_time": now_iso(), "attempts": []}, lock)

    def _begin_attempt(self, meta: Mapping[str, Any], attempt: Mapping[str, Any] | None) -> None:
        """A new entry in meta["attempts"] (its commit and dirty flag), the top level's dirty flag
        summed over all attempts, and the status `running`, on disk before the open lock goes."""
        git = dict(meta.get("git") or {})
        entry = {"start_time": now_iso(), "git_commit": git.get("commit"), "dirty": git.get("dirty"),
                 **(attempt or {})}
        self.meta["attempts"] = [*self.meta.get("attempts", []), entry]
        dirty = run_dirty(self.meta["attempts"])
        self.meta["git"] = {**git, "dirty": dirty}
        self.meta["dirty"] = dirty
        self.set_status("running")

    def close(self) -> None:
        """Release the lock (the process exiting releases it too)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def resumed(self) -> bool:
        return len(self.meta["attempts"]) > 1

    def update(self, **fields: Any) -> None:
        """meta.json with `fields`; on a full disk, rewritten over its own blocks instead."""
        self.meta.update(fields)
        try:
            write_json(self.path / runfiles.META, self.meta)
        except OSError as e:
            if not disk_problem(e) or not (self.path / runfiles.META).is_file():
                raise
            rewrite_in_place(self.path / runfiles.META, self.meta)

    def set_status(self, status: str, error: str | None = None) -> None:
        """running | completed | interrupted | failed; closes the current attempt's timing."""
        attempt = self.meta["attempts"][-1]
        attempt["status"] = status
        if status != "running":
            attempt["end_time"] = now_iso()
            attempt["wall_s"] = round(time.monotonic() - self.started, 3)
            self.meta["end_time"] = attempt["end_time"]
            self.meta["wall_s"] = round(sum(a.get("wall_s", 0.0) for a in self.meta["attempts"]), 3)
        self.meta.update(status=status, error=error)
        if status == "completed":  # the run's files as it leaves them (kvnotes.measure.digests)
            self.meta["digests"] = run_digests(self.path, self.meta)
        self.update()

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        write_json(self.path / runfiles.SUMMARY, dict(summary))
