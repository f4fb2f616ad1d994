"""Run directories: provenance, resumable record units written atomically, summaries.

A run lives in <results_dir>/<probe-or-experiment>/<model>/<timestamp>/ with config.yaml,
meta.json (provenance, timing, status), parts/<unit>.parquet while it runs, then
records.parquet and summary.json. Each unit (an item, a block) is written to a temporary file
and renamed into place, so a unit is either wholly on disk or absent; a rerun with the same
config hash continues in the newest unfinished directory and skips the units already there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
UNIT = "unit"  # column naming the unit a record was written in
NOT_HASHED = ("resume", "results_dir", "cache_dir", "progress", "threads")  # do not change results


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (tmp + rename). NaN is written as NaN, never replaced by a sentinel."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def config_hash(cfg: DictConfig, device: str) -> str:
    """sha256 (12 hex) of the resolved config minus the keys that cannot change a result."""
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    data = {k: v for k, v in data.items() if k not in NOT_HASHED and k != "hydra"}
    data["_device"] = device
    blob = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def unit_filename(key: object) -> str:
    """A safe, unique file stem for a unit key (unsafe characters replaced, hash appended)."""
    text = str(key)
    safe = re.sub(r"[^A-Za-z0-9._=-]", "_", text)[:80]
    if safe != text or safe.startswith("."):
        safe = f"{safe}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
    return safe


class RecordWriter:
    """Appends the records of one unit at a time as parts/<unit>.parquet, atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.parts = run_dir / "parts"
        self.records_path = run_dir / "records.parquet"
        self.parts.mkdir(parents=True, exist_ok=True)

    def _path(self, key: object) -> Path:
        return self.parts / f"{unit_filename(key)}.parquet"

    def done(self, key: object) -> bool:
        """Whether this unit is already on disk (a rerun skips it)."""
        return self._path(key).exists()

    def write(self, key: object, records: Iterable[Mapping[str, Any]]) -> None:
        """All records of unit `key` (possibly none: the unit still counts as done)."""
        rows = [dict(r) for r in records]
        if any(UNIT in r for r in rows):
            raise ValueError(f"records may not carry a {UNIT!r} column; it names the unit")
        frame = pd.DataFrame(rows)
        frame.insert(0, UNIT, str(key))
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)

    def n_done(self) -> int:
        return len(list(self.parts.glob("*.parquet")))

    def read(self) -> pd.DataFrame:
        """Every unit written so far, concatenated in unit-file order."""
        frames = [pd.read_parquet(p) for p in sorted(self.parts.glob("*.parquet"))]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({UNIT: []})

    def finalize(self) -> pd.DataFrame:
        """Concatenate the parts into records.parquet (atomically); the parts stay until cleanup."""
        frame = self.read()
        tmp = self.records_path.with_name(f".{self.records_path.name}.tmp")
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, self.records_path)
        return frame

    def cleanup(self) -> None:
        """Drop the parts once the run is completed (records.parquet holds them all).

        Never raises: a leftover file (a `.tmp` of a killed attempt) or a part another tool
        holds open is logged and left, since the run itself is complete.
        """
        if not self.parts.is_dir():
            return
        for p in self.parts.iterdir():
            if p.suffix in (".parquet", ".tmp") and p.is_file():
                p.unlink(missing_ok=True)
        try:
            self.parts.rmdir()
        except OSError as e:
            log.warning("left %s in place: %s", self.parts, e.strerror or e)


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


class RunDirError(Exception):
    """A run directory that cannot be used: not writable, held by another process, or (to resume)
    started at another commit."""


def new_dir(parent: Path) -> Path:
    """parent/<timestamp>, with a -1, -2, ... suffix if that second is already taken."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run directory under {parent}: {e.strerror or e}") from None
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


def _status(path: Path, chash: str) -> str | None:
    """The status in path/meta.json when its config hash is `chash`, else None."""
    try:
        m = read_json(path / "meta.json")
    except (OSError, json.JSONDecodeError):
        return None
    return str(m.get("status")) if m.get("config_hash") == chash else None


def find_unfinished(parent: Path, chash: str) -> Path | None:
    """The newest run under `parent` with this config hash whose status is not completed."""
    if not parent.is_dir():
        return None
    for path in sorted((p for p in parent.iterdir() if p.is_dir()), reverse=True):
        status = _status(path, chash)
        if status is not None and status != "completed":
            return path
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


class RunLock:
    """An exclusive lock on a run directory (filelock: flock, freed by the OS if the holder dies).

    The holder writes its pid, host and start time to `.holder.json` beside the lock, so a
    second process that finds the directory taken can say by whom.
    """

    LOCK = ".lock"
    HOLDER = ".holder.json"

    def __init__(self, path: Path) -> None:
        from filelock import FileLock

        self.path = path
        self._lock = FileLock(str(path / self.LOCK))

    def acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        from filelock import Timeout

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

        The directory is locked for as long as this RunDir is open (`close`). An unfinished run
        that another process holds is refused (RunDirError naming the holder) rather than
        shared; one that completed between the search and the lock is left alone.
        """
        parent = Path(results_dir) / job / model
        run: RunDir | None = None
        while resume and run is None:
            found = find_unfinished(parent, chash)
            if found is None:
                break
            lock = RunLock(found)
            if not lock.acquire():
                raise RunDirError(f"{found} is in use by {lock.holder()}: wait for it to finish, or "
                                  "pass resume=false to start a separate run")
            if _status(found, chash) == "completed":  # finished while we looked: never rewrite it
                lock.release()
                continue
            old = read_json(found / "meta.json")
            problem = commit_problem(found, old, meta)
            if problem:
                lock.release()
                raise RunDirError(problem)
            run = cls(found, {**old, **meta, "start_time": old.get("start_time")}, lock)
        if run is None:
            path = new_dir(parent)
            lock = RunLock(path)
            if not lock.acquire():  # nobody else knows this directory yet
                raise RunDirError(f"{path} is in use by {lock.holder()}")
            (path / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            run = cls(path, {**meta, "config_hash": chash, "start_time": now_iso(), "attempts": []}, lock)
        entry = {"start_time": now_iso(), "git_commit": meta.get("git", {}).get("commit"),
                 **(attempt or {})}
        run.meta["attempts"] = [*run.meta.get("attempts", []), entry]
        run.set_status("running")
        return run

    def close(self) -> None:
        """Release the lock (the process exiting releases it too)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def resumed(self) -> bool:
        return len(self.meta["attempts"]) > 1

    def update(self, **fields: Any) -> None:
        self.meta.update(fields)
        write_json(self.path / "meta.json", self.meta)

    def set_status(self, status: str, error: str | None = None) -> None:
        """running | completed | interrupted | failed; closes the current attempt's timing."""
        attempt = self.meta["attempts"][-1]
        attempt["status"] = status
        if status != "running":
            attempt["end_time"] = now_iso()
            attempt["wall_s"] = round(time.monotonic() - self.started, 3)
            self.meta["end_time"] = attempt["end_time"]
            self.meta["wall_s"] = round(sum(a.get("wall_s", 0.0) for a in self.meta["attempts"]), 3)
        self.update(status=status, error=error)

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        write_json(self.path / "summary.json", dict(summary))


HEADLINE = ("n_items", "n_usable", "n_skipped", "n_usable_recovery", "n_usable_p_correct", "margin")


def _ci_rows(node: Any, path: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    if isinstance(node, Mapping):
        if "mean" in node and "n" in node:
            yield path, node
            return
        for key, sub in node.items():
            yield from _ci_rows(sub, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list) and node and all(isinstance(x, Mapping) and "mean" in x for x in node):
        for x in node:  # a curve: label each point by its first non-statistic key (k, layer, band)
            label = next((f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in x.items() if k not in ("mean", "ci_lo", "ci_hi", "n")), "")
            yield f"{path}[{label}]", x


def _cell(r: Mapping[str, Any]) -> str:
    def num(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, int | float) and x == x else "nan"

    return f"{num(r['mean'])} [{num(r.get('ci_lo'))}, {num(r.get('ci_hi'))}] n={r['n']}"


def summary_table(summary: Mapping[str, Any], max_rows: int = 60) -> str:
    """A short plain-text table of a summary: the item counts, then every mean with its CI and n,
    then the summary's one-line `reading` and its `margin_rule`.

    Metrics that repeat under several groups (p_correct, recovery, ... per strategy) become one
    row per group with a column per metric; a curve (a list of points) gives a row per point.
    A run with no usable item prints one line saying so and what to try, never a table of NaN.
    """
    title = " ".join(str(summary[k]) for k in ("kind", "name", "model") if k in summary)
    counts = "  ".join(f"{k}={summary[k]}" for k in HEADLINE if k in summary)
    rows = list(_ci_rows({k: v for k, v in summary.items() if k not in HEADLINE}, ""))
    lines = [title, counts] if counts else [title]
    if summary.get("no_usable") or (rows and summary.get("n_items") and all(not r.get("n") for _, r in rows)):
        return "\n".join([*lines, str(summary.get("no_usable") or (
            f"no usable item: every mean is over 0 of {summary['n_items']} items at margin "
            f"{summary.get('margin')}. Try a model that conditions on the field (qwen-1.5b) or a margin "
            "derived by the rule of kvnotes.measure.margins (python -m analysis.margin <gated-control run>)."))])
    notes = [f"{k.replace('_', ' ')}: {summary[k]}" for k in ("reading", "margin_rule")
             if isinstance(summary.get(k), str)]

    def cell(r: Mapping[str, Any]) -> str:  # timings carry a min-max range, never called a CI
        if r.get("interval") == "min-max":
            return f"{r['mean']:.3f} (min-max {r['min']:.3f}-{r['max']:.3f}) n={r['n']}"
        return _cell(r)
    groups: dict[str, dict[str, Mapping[str, Any]]] = {}
    for path, r in rows:
        head, _, leaf = path.rpartition(".")
        groups.setdefault(head, {})[leaf] = r
    leaves = [tuple(g) for g in groups.values()]
    wide = len(groups) > 1 and all(len(g) > 1 for g in leaves) and len(set(leaves)) == 1
    if not rows:
        scalars = [f"{k}: {v}" for k, v in summary.items()
                   if isinstance(v, int | float | str | bool) and k not in ("kind", "name", "model", "finished")
                   and k not in ("reading", "margin_rule")]
        return "\n".join(lines + scalars + notes)
    if wide:
        cols = list(leaves[0])
        table = [["", *cols]] + [[head, *(cell(g[c]) for c in cols)] for head, g in groups.items()]
    else:
        table = [["metric", "mean [95% CI] n"]] + [[p, cell(r)] for p, r in rows]
    shown = table[: max_rows + 1]
    widths = [max(len(row[i]) for row in shown) for i in range(len(shown[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in shown]
    if len(table) > len(shown):
        lines.append(f"... {len(table) - len(shown)} more rows in summary.json")
    return "\n".join(lines + notes)
