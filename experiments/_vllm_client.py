"""Client side of the serving benchmark (experiment `serving`): read vLLM's /metrics, stream
completions, drive a seeded Poisson load, all on loopback with the standard library only.

The benchmark compares how an engine's automatic prefix cache treats a state change.
An in-prefix edit changes a token near the top of the prompt, so every block after it misses;
an appended erratum leaves the prefix byte-identical, so all full blocks before it hit:
hit rate = delta `vllm:prefix_cache_hits_total` / delta `vllm:prefix_cache_queries_total`
~ floor(prefix / block) * block / prompt tokens. TTFT is measured client side from the
request's send to the first streamed chunk; arrivals are a seeded Poisson process.
Nothing here leaves 127.0.0.1 unless given a URL. The server process: experiments/_vllm_server.py.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


