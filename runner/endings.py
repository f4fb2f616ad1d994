"""How a run ends: `interrupted` on SIGINT and SIGTERM, `failed` with one line on a full disk.

SIGTERM is what a scheduler, `timeout` or `kill` sends. While a run is open it raises
`Terminated` (a KeyboardInterrupt), so the run ends as Ctrl-C ends it: status `interrupted`,
finished units kept, one line. The previous handler is restored when the run closes. A full,
over-quota or read-only disk is the disk, not the code: the temporary files are removed, the
status is recorded (over meta.json's own blocks when nothing new can be written) and the user
sees one `error:` line instead of a chained traceback.
"""

from __future__ import annotations

import logging
import shlex
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from kvnotes.measure import runfiles
from runner.files import RunDirError, disk_problem, remove_tmp
from runner.rundir import RunDir

log = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a run was open."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signal.Signals(signum).name}")


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside the block (main thread only; restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: Any = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def interrupted_line(e: KeyboardInterrupt) -> tuple[str, int]:
    """What the command line prints for an interrupted run, and its exit status."""
    how, code = (" (SIGTERM)", 143) if isinstance(e, Terminated) else ("", 130)
    return f"interrupted{how}: finished units are on disk; rerun the same command to resume", code


def record_end(rd: RunDir, status: str, error: str | None = None) -> None:
    """The run's final status on disk, or one logged line when even that cannot be written."""
    try:
        rd.set_status(status, error=error)
    except OSError as e:
        log.error("could not record status %s in %s: %s", status, rd.path / runfiles.META, e.strerror or e)


def disk_failure(rd: RunDir, e: BaseException) -> RunDirError | None:
    """For a full, over-quota or read-only disk: the run marked failed, its temporary files
    removed, and the one-line error to raise; None for any other exception."""
    problem = disk_problem(e)
    if problem is None:
        return None
    remove_tmp(rd.path)
    where = f" ({getattr(e, 'filename', None)})" if getattr(e, "filename", None) else ""
    fix = "make it writable" if "read-only" in problem.lower() else "free space"
    record_end(rd, "failed", error=f"{problem}{where}")
    return RunDirError(f"{rd.path}: {problem}{where}; the run is marked failed and its finished "
                       f"units are kept: {fix} and rerun the same command to resume")


def reading_tip(run_dir: Path, cwd: Path | None = None) -> str:
    """How to read a finished run: the figures and the report read results/reference (the committed
    runs) unless told otherwise, and write beside them; this points both at the run's results folder."""
    results = run_dir.parents[2]  # <results_dir>/<job>/<model>/<timestamp>
    try:
        results = results.resolve().relative_to((cwd or Path.cwd()).resolve())
    except ValueError:
        pass  # outside the working folder: the absolute path
    r = shlex.quote(str(results))
    return (f"read it (the newest run per job, model, task and seed under {results}):\n"
            f"  python -m analysis.figures --results {r} --out {shlex.quote(str(results / 'figures'))}\n"
            f"  kvnotes report --results {r} --figures {shlex.quote(str(results / 'figures'))} "
            f"--out {shlex.quote(str(results / 'REPORT.md'))}\n"
            f"(without --results they read results/reference, the committed runs)")
