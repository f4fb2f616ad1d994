"""Run a command so that it cannot outlive the process that started it (Linux), even when that
process is killed with SIGKILL and has no chance to clean up.

    python watchdog.py PARENT_PID -- COMMAND...

The watchdog is started as the leader of a new session and process group; the command is its
child, in the same group, and so are the command's own children (vLLM's engine processes). The
kernel sends the watchdog SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG, set before the
parent pid is checked once, so a parent that died earlier is seen too); a poll of getppid()
every 0.2 s backs it up. Either way the watchdog kills its whole process group with SIGKILL. The
command also gets PR_SET_PDEATHSIG = SIGKILL towards the watchdog (a small preexec_fn through
ctypes, safe here because the watchdog has no other thread), so a watchdog killed on its own
takes the command with it; the command's own children (vLLM's EngineCore and Worker) are not
its children, so a sentinel, forked into the group before the command starts, watches the
watchdog the same way (death signal plus a getppid poll) and kills the whole group when it
dies; the watchdog kills the group when the sentinel dies. SIGKILL to any one process of the
guard takes the whole group down. When the command exits, the watchdog kills what is left of the
group (the sentinel included) and exits with the command's status. SIGINT and a SIGTERM while the parent lives are
ignored: the owner stops the server by signalling the whole group (serving/server.py).

Standard library only, run by path: it must not import the project.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.2


_PRCTL: Any
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # loaded once, before any fork
except (OSError, AttributeError):  # not Linux: the getppid poll alone
    _PRCTL = None


def set_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only)."""
    return _PRCTL is not None and int(_PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0


def _child_setup() -> None:
    """preexec_fn of the command: SIGINT back to its default, killed when the watchdog dies."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    set_death_signal(signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group `pgid`, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(d.name))
    return out


def kill_group() -> None:
    """SIGKILL to every process of our group, this one included (never returns)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(137)  # not reached


def start_sentinel() -> int:
    """Fork a process of this group that kills the group when the watchdog (its parent) dies,
    however it dies; the sentinel's pid."""
    watchdog = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # the sentinel: no return from here
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda s, f: kill_group() if os.getppid() != watchdog else None)
        set_death_signal(signal.SIGTERM)
        while os.getppid() == watchdog:
            time.sleep(POLL_S)
        kill_group()
    finally:
        os._exit(0)


def exited(pid: int) -> bool:
    """Whether child `pid` has exited (it is reaped here if so)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: watchdog.py PARENT_PID -- COMMAND...\n")
        return 2
    parent, cmd = int(argv[1]), argv[3:]
    if os.getpgrp() != os.getpid():  # never kill a group we were merely born into
        os.setsid()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != parent:  # the death signal: the parent is gone
            kill_group()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # died before the death signal was armed
        kill_group()
    sentinel = start_sentinel()
    child = subprocess.Popen(cmd, preexec_fn=_child_setup)
    while child.poll() is None:
        if os.getppid() != parent or exited(sentinel):  # the parent or the sentinel is gone
            kill_group()
        time.sleep(POLL_S)
    me = os.getpid()
    for pid in group_members(os.getpgrp()):  # what the command left behind
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    code = child.returncode
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
