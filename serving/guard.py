"""Child processes of an experiment that cannot outlive it: each runs under
serving/watchdog.py, the leader of its own session and process group, which the kernel
signals when the experiment dies (PR_SET_PDEATHSIG) and which then kills the whole group; a
sentinel in the group does the same if the watchdog itself is killed. Used for the vLLM server
(serving/server.py) and the kvboost worker (experiments/shared/kvboost.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

WATCHDOG = Path(__file__).with_name("watchdog.py")


def guarded_argv(argv: list[str]) -> list[str]:
    return [sys.executable, str(WATCHDOG), str(os.getpid()), "--", *argv]


def spawn_guarded(argv: list[str], env: dict[str, str] | None = None,
                  stdout: IO[Any] | int | None = None) -> subprocess.Popen[bytes]:
    """`argv` started under the watchdog, in a new session and process group whose leader is the
    watchdog (pid = pgid of the returned process): the group dies with this process, however
    this process dies. `os.killpg(proc.pid, sig)` reaches the command and all its children."""
    return subprocess.Popen(guarded_argv(argv), env=env, stdout=stdout,
                            stderr=subprocess.STDOUT if stdout is not None else None,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_guarded(argv: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    """`argv` to completion under the watchdog, stdout and stderr captured as text (what
    `subprocess.run(..., capture_output=True, text=True, timeout=...)` returns). On a timeout
    (TimeoutExpired), Ctrl-C or any other exception the whole group is killed first; if this
    process is killed outright, the watchdog kills it."""
    proc = subprocess.Popen(guarded_argv(argv), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
