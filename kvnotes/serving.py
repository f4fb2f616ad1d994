"""A real serving engine on loopback: start/stop a vLLM server, stream completions, read /metrics.

The serving benchmark compares how an engine's automatic prefix cache treats a state change.
An in-prefix edit changes a token near the top of the prompt, so every block after it misses;
an appended erratum leaves the prefix byte-identical, so all full blocks before it hit:
hit rate = delta `vllm:prefix_cache_hits_total` / delta `vllm:prefix_cache_queries_total`
~ floor(prefix / block) * block / prompt tokens. TTFT is measured client side from the
request's send to the first streamed chunk; arrivals are a seeded Poisson process.
Only the standard library talks to the server; nothing here leaves 127.0.0.1 unless given a URL.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

# --- Prometheus text format -------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
TTFT = "vllm:time_to_first_token_seconds"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (metric name, sorted labels) -> value


def parse_metrics(text: str) -> Samples:
    """Samples of a Prometheus text exposition (comments skipped, `+Inf`/`NaN` parsed)."""
    out: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample: {line!r}")
        labels = tuple(sorted((k, v) for k, v in _LABEL.findall(m.group(3) or "")))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def total(samples: Samples, name: str, **match: str) -> float:
    """Sum of a metric over all label sets (those matching `match`); NaN when absent."""
    vals = [v for (n, lab), v in samples.items()
            if n == name and all(dict(lab).get(k) == want for k, want in match.items())]
    return math.fsum(vals) if vals else math.nan


def buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    """Cumulative histogram buckets (upper bound, count) of `name`, summed over other labels."""
    acc: dict[float, float] = {}
    for (n, lab), v in samples.items():
        if n == f"{name}_bucket":
            le = float(dict(lab)["le"])
            acc[le] = acc.get(le, 0.0) + v
    return sorted(acc.items())


def histogram_quantile(cum: Sequence[tuple[float, float]], q: float) -> float:
    """Quantile from cumulative buckets, linear inside a bucket (Prometheus' rule); NaN if empty."""
    if not cum or cum[-1][1] <= 0:
        return math.nan
    rank, prev_le, prev_c = q * cum[-1][1], 0.0, 0.0
    for le, c in cum:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_le, prev_c = le, c
    return prev_le


@dataclass(frozen=True)
class Counters:
    """The server's cumulative counters at one instant; `b - a` is what happened in between."""

    hits: float
    queries: float
    ttft_sum: float
    ttft_count: float
    ttft_buckets: tuple[tuple[float, float], ...]
    running: float
    waiting: float

    @classmethod
    def of(cls, samples: Samples) -> Counters:
        return cls(total(samples, HITS), total(samples, QUERIES), total(samples, f"{TTFT}_sum"),
                   total(samples, f"{TTFT}_count"), tuple(buckets(samples, TTFT)),
                   total(samples, RUNNING), total(samples, WAITING))

    def __sub__(self, a: Counters) -> dict[str, float]:
        """Deltas since `a`: prefix-cache hit rate and the server's own TTFT mean and p50/p90."""
        before = dict(a.ttft_buckets)
        cum = [(le, c - before.get(le, 0.0)) for le, c in self.ttft_buckets]
        dq, dh, dn = self.queries - a.queries, self.hits - a.hits, self.ttft_count - a.ttft_count
        return {
            "hit_tokens": dh, "query_tokens": dq, "hit_rate": dh / dq if dq > 0 else math.nan,
            "server_ttft_n": dn,
            "server_ttft_mean_s": (self.ttft_sum - a.ttft_sum) / dn if dn > 0 else math.nan,
            "server_ttft_p50_s": histogram_quantile(cum, 0.5),
            "server_ttft_p90_s": histogram_quantile(cum, 0.9),
        }


# --- HTTP -------------------------------------------------------------------------------------


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, http.client.HTTPException):
        return 0, ""


def counters(base_url: str) -> Counters:
    status, body = get(base_url.rstrip("/") + "/metrics")
    if status != 200:
        raise ConnectionError(f"{base_url}/metrics answered {status}")
    return Counters.of(parse_metrics(body))


def served_models(base_url: str) -> list[str]:
    """Model names the server answers to (GET /v1/models)."""
    status, body = get(base_url.rstrip("/") + "/v1/models")
    if status != 200:
        raise ConnectionError(f"{base_url}/v1/models answered {status}")
    return [m["id"] for m in json.loads(body).get("data", [])]


def wait_idle(base_url: str, timeout: float = 600.0, poll: float = 0.5) -> Counters:
    """Counters once no request is running or waiting (raises TimeoutError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        c = counters(base_url)
        if not (c.running > 0 or c.waiting > 0):
            return c
        if time.monotonic() > deadline:
            raise TimeoutError(f"server still busy after {timeout:.0f} s: {c.running:.0f} running, "
                               f"{c.waiting:.0f} waiting")
        time.sleep(poll)


@dataclass
class Completion:
    """One streamed completion, timed from the send (`start` on the caller's monotonic clock)."""

    start: float
    ttft_s: float = math.nan  # to the first streamed chunk with a choice
    latency_s: float = math.nan  # to the end of the stream
    text: str = ""
    prompt_tokens: float = math.nan  # the server's count (usage chunk)
    completion_tokens: float = math.nan
    status: str = "pending"  # ok | cancelled | error
    error: str = ""


class StreamingRequest:
    """A /v1/completions request with stream=true; `cancel()` (any thread) closes its socket."""

    def __init__(self, base_url: str, body: Mapping[str, Any], timeout: float = 600.0) -> None:
        u = urllib.parse.urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.path = (u.path.rstrip("/") or "") + "/v1/completions"
        self.body = json.dumps({**body, "stream": True,
                                "stream_options": {"include_usage": True}}).encode()
        self.timeout = timeout
        self._sock: socket.socket | None = None  # kept: http.client drops conn.sock on Connection: close
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def run(self) -> Completion:
        out = Completion(start=time.monotonic())
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.connect()
            self._sock = conn.sock
            if self._cancelled.is_set():
                raise ConnectionAbortedError("cancelled before sending")
            conn.request("POST", self.path, body=self.body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace')}")
            for event in _sse(resp):
                if event.get("error"):
                    raise RuntimeError(str(event["error"]))
                for ch in event.get("choices") or []:
                    if math.isnan(out.ttft_s):
                        out.ttft_s = time.monotonic() - out.start
                    out.text += ch.get("text") or ""
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens = float(usage.get("prompt_tokens", math.nan))
                    out.completion_tokens = float(usage.get("completion_tokens", math.nan))
            out.latency_s = time.monotonic() - out.start
            out.status = "ok"
        except Exception as e:  # noqa: BLE001 - any failure is recorded on the request
            out.status = "cancelled" if self._cancelled.is_set() else "error"
            out.error = f"{type(e).__name__}: {e}"[:500]
        finally:
            conn.close()
        return out


def _sse(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event stream, up to `data: [DONE]`."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)
    raise ConnectionError("the stream ended before [DONE]")


# --- Load -------------------------------------------------------------------------------------


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send offsets (s) of `n` requests with exponential gaps of mean 1/rate; the first at 0."""
    if not rate > 0 or n < 0:
        raise ValueError(f"rate must be > 0 and n >= 0, got rate={rate}, n={n}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass
class Sent:
    """A request of a load run: its index, scheduled offset and what came back."""

    index: int
    arrival_s: float
    result: Completion
    cutoff_s: float = math.nan  # phase time at which it was cancelled (censored), else NaN


def run_load(make: Callable[[int], StreamingRequest], arrivals: Sequence[float],
             max_seconds: float) -> tuple[list[Sent], float]:
    """Send request i at offset arrivals[i] (threads), none after `max_seconds`; at that cap
    cancel what is still open. Returns the requests sent, in order, and the phase's wall time.
    A request never sent is left out; a cancelled one keeps its partial timing (status cancelled).
    """
    t0 = time.monotonic()
    sent: list[Sent] = []
    live: list[tuple[StreamingRequest, threading.Thread]] = []
    lock = threading.Lock()

    def worker(i: int, req: StreamingRequest, arrival: float) -> None:
        res = req.run()
        with lock:
            sent.append(Sent(i, arrival, res))

    for i, at in enumerate(arrivals):
        delay = t0 + at - time.monotonic()
        if at > max_seconds:
            break
        if delay > 0:
            time.sleep(delay)
        req = make(i)
        th = threading.Thread(target=worker, args=(i, req, at), daemon=True)
        th.start()
        live.append((req, th))
    for req, th in live:
        th.join(max(0.0, t0 + max_seconds - time.monotonic()))
        if th.is_alive():
            req.cancel()
    cutoff = time.monotonic() - t0
    for _, th in live:
        th.join(30.0)
    with lock:
        out = sorted(sent, key=lambda s: s.index)
    for s in out:
        if s.result.status == "cancelled":
            s.cutoff_s = cutoff
    return out, time.monotonic() - t0


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
                self.dtype, "--max-model-len", str(self.max_model_len)]
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

    The child runs in its own process group, which `stop()` signals (SIGINT, then SIGKILL), so
    the engine's worker processes go with it; SIGTERM to this process is turned into SystemExit
    while the server runs, so `finally` blocks (and `stop`) run on a kill as on Ctrl-C.
    """

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout: float = 900.0) -> None:
        self.spec, self.log_path, self.startup_timeout = spec, Path(log_path), startup_timeout
        self.port = spec.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s = math.nan
        self._log: TextIO | None = None
        self._old_term: Any = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self._log.write(" ".join(self.spec.argv(self.port)) + "\n")
        self._log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.spec.argv(self.port), env=self.spec.env(),
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        self.wait_ready()
        self.startup_s = time.monotonic() - t0

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
