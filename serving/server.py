"""The vLLM server process of the serving benchmark (experiment `serving`): started on a free
loopback port from its own venv, waited for, and always stopped (process group, SIGINT then
SIGKILL), also when the experiment is interrupted, and also when it is killed outright: the
server runs under serving/watchdog.py, the leader of its process group, which the kernel
signals when the experiment dies (PR_SET_PDEATHSIG) and which then kills the whole group (as its
sentinel does if the watchdog alone is killed: vLLM's EngineCore and Worker go too).
The client side: serving/client.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from serving.client import get
from serving.guard import WATCHDOG as WATCHDOG
from serving.guard import spawn_guarded as spawn_guarded

# --- The server process -----------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _cpus() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"{cpus[0]}-{cpus[-1]}" if cpus and cpus == list(range(cpus[0], cpus[-1] + 1)) else \
        ",".join(map(str, cpus)) or "0"


@dataclass
class ServerSpec:
    """How to start `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1."""

    python: str  # the interpreter that has vllm (the serving venv's)
    model_path: str  # an HF folder (config, safetensors, tokenizer)
    served_name: str = "model"
    port: int = 0  # 0: a free port
    max_model_len: int = 8192
    block_size: int = 32
    dtype: str = "bfloat16"
    kv_cache_gib: float = 4.0  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: every CPU of this process
    enforce_eager: bool = True
    extra_args: list[str] = field(default_factory=list)

    def argv(self, port: int) -> list[str]:
        args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                "--enable-prefix-caching", "--block-size", str(self.block_size), "--dtype",
                self.dtype, "--max-model-len", str(self.max_model_len),
                "--enable-prompt-tokens-details"]  # usage.prompt_tokens_details.cached_tokens
        return args + (["--enforce-eager"] if self.enforce_eager else []) + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gib:g}")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", self.cpu_bind or _cpus())
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        return env


class ServerError(RuntimeError):
    """The server exited or never became ready; the message ends with its log's tail."""


class Server:
    """A vLLM server child process: `with Server(spec, log) as s:` starts, waits, always stops.

    The child (the watchdog, then vLLM under it) runs in its own process group, which `stop()`
    signals (SIGINT, then SIGKILL), so the engine's worker processes go with it; SIGTERM to this
    process is turned into SystemExit while the server runs, so `finally` blocks (and `stop`)
    run on a kill as on Ctrl-C; on SIGKILL the watchdog takes the group down.
    """

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout: float = 900.0) -> None:
        self.spec, self.log_path, self.startup_timeout = spec, Path(log_path), startup_timeout
        self.port = spec.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = math.nan
        self._log: TextIO | None = None
        self._old_term: Any = None
        self._t0 = math.nan

    def launch(self) -> None:
        """Start the process (under the watchdog) without waiting for it to answer."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self._log.write(" ".join(self.spec.argv(self.port)) + "\n")
        self._log.flush()
        self._t0 = time.monotonic()
        self.proc = spawn_guarded(self.spec.argv(self.port), self.spec.env(), self._log)
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_exit)

    def start(self) -> None:
        self.launch()
        self.wait_ready()
        self.startup_s = time.monotonic() - self._t0

    def wait_ready(self, poll: float = 1.0) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM exited with {self.proc.returncode} before it was ready; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if get(self.url + "/health", timeout=5.0)[0] == 200:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"vLLM not ready after {self.startup_timeout:.0f} s; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(poll)

    def stop(self, timeout: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group
                os.killpg(proc.pid, signal.SIGKILL)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
