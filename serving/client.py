"""Client side of the serving benchmark (experiment `serving`): read vLLM's /metrics, stream
completions with httpx, drive a seeded Poisson load with a time cap, on loopback.

The benchmark compares how an engine's automatic prefix cache treats a state change.
An in-prefix edit changes a token near the top of the prompt, so every block after it misses;
an appended erratum leaves the prefix byte-identical, so all full blocks before it hit:
hit rate = delta `vllm:prefix_cache_hits_total` / delta `vllm:prefix_cache_queries_total`
~ floor(prefix / block) * block / prompt tokens, read from vLLM's own Prometheus counters.
TTFT is measured client side from the request's send to the first streamed chunk with a
choice (as `vllm bench serve` does); arrivals are a seeded Poisson process. Requests still open
at a phase's cap are cancelled (their stream closed, so vLLM aborts them) and kept as censored.
The Prometheus text is parsed by prometheus_client's parser (vLLM depends on it too) and the
stream by httpx-sse; what is left here is Prometheus' `histogram_quantile` rule (a PromQL
function that prometheus_client does not ship: 10 lines). Proxies from the environment are not used (trust_env=False): the server is ours, on 127.0.0.1, unless given a URL.
The server process: serving/server.py; vLLM's own load generator:
serving/bench.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

# --- Prometheus text format -------------------------------------------------------------------

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
TTFT = "vllm:time_to_first_token_seconds"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]  # (metric name, sorted labels) -> value


def parse_metrics(text: str) -> Samples:
    """Samples of a Prometheus text exposition, by sample name (`..._total`, `..._bucket`) and
    label set (escapes undone); ValueError on a line that is not one."""
    out: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    except (ValueError, IndexError, KeyError) as e:  # the parser's ways of refusing a line
        raise ValueError(f"not a Prometheus text exposition: {e}") from e
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
        r = httpx.get(url, timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return 0, ""
    return r.status_code, r.text


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

    start: float = math.nan
    ttft_s: float = math.nan  # to the first streamed chunk with a choice
    latency_s: float = math.nan  # to the end of the stream
    text: str = ""
    prompt_tokens: float = math.nan  # the server's count (usage chunk)
    completion_tokens: float = math.nan
    cached_tokens: float = math.nan  # prefix-cache hits of this request (vLLM: --enable-prompt-tokens-details)
    status: str = "pending"  # ok | cancelled | error
    error: str = ""


def async_client(base_url: str, timeout: float = 900.0) -> httpx.AsyncClient:
    """An httpx client for one phase: no connection limit (the load decides), no env proxies."""
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), trust_env=False,
                             timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def complete(client: httpx.AsyncClient, body: Mapping[str, Any]) -> Completion:
    """POST /v1/completions with stream=true; a cancelled task returns its partial timing."""
    out = Completion(start=time.monotonic())
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with aconnect_sse(client, "POST", "/v1/completions", json=payload) as source:
            resp = source.response
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:2000]
                raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
            # TTFT: taken when the first event with a choice has been read, as before
            async for event in _events(source.aiter_sse()):
                if event.get("error"):
                    raise RuntimeError(str(event["error"]))
                for ch in event.get("choices") or []:
                    if math.isnan(out.ttft_s):
                        out.ttft_s = time.monotonic() - out.start
                    out.text += ch.get("text") or ""
                _usage(out, event.get("usage"))
        out.latency_s = time.monotonic() - out.start
        out.status = "ok"
    except asyncio.CancelledError:  # the phase cap: the stream is closed, vLLM aborts the request
        out.status, out.error = "cancelled", "cancelled at the phase cap"
    except Exception as e:  # noqa: BLE001 - any failure is recorded on the request
        out.status, out.error = "error", f"{type(e).__name__}: {e}"[:500]
    return out


def _usage(out: Completion, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    out.prompt_tokens = float(usage.get("prompt_tokens", math.nan))
    out.completion_tokens = float(usage.get("completion_tokens", math.nan))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out.cached_tokens = math.nan if cached is None else float(cached)


async def _events(sse: AsyncIterator[ServerSentEvent]) -> AsyncIterator[dict[str, Any]]:
    """The JSON data of the server-sent events (httpx-sse joins multi-line data), up to [DONE]."""
    async for event in sse:
        data = event.data.strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)
    raise ConnectionError("the stream ended before [DONE]")


def complete_one(base_url: str, body: Mapping[str, Any], timeout: float = 900.0) -> Completion:
    """One request, waited for (the sequential phases)."""
    async def one() -> Completion:
        async with async_client(base_url, timeout) as client:
            return await complete(client, body)
    return asyncio.run(one())


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


def run_load(base_url: str, bodies: Sequence[Mapping[str, Any]], arrivals: Sequence[float],
             max_seconds: float = math.inf, timeout: float = 900.0) -> tuple[list[Sent], float]:
    """Send bodies[i] at offset arrivals[i] (one asyncio task each), none after `max_seconds`;
    at that cap cancel what is still open. Returns the requests sent, in order, and the phase's
    wall time. A request never sent is left out; a cancelled one keeps status `cancelled`."""
    if len(bodies) != len(arrivals):
        raise ValueError(f"{len(bodies)} bodies for {len(arrivals)} arrivals")
    return asyncio.run(_load(base_url, bodies, arrivals, max_seconds, timeout))


async def _load(base_url: str, bodies: Sequence[Mapping[str, Any]], arrivals: Sequence[float],
                max_seconds: float, timeout: float) -> tuple[list[Sent], float]:
    t0 = time.monotonic()
    async with async_client(base_url, timeout) as client:
        async def send(i: int) -> Completion:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
            return await complete(client, bodies[i])

        tasks = {asyncio.create_task(send(i)): i for i, at in enumerate(arrivals) if at <= max_seconds}
        cap = None if math.isinf(max_seconds) else max(0.0, t0 + max_seconds - time.monotonic())
        _, pending = await asyncio.wait(tasks, timeout=cap) if tasks else (set(), set())
        cutoff = time.monotonic() - t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    out = []
    for task, i in sorted(tasks.items(), key=lambda kv: kv[1]):
        if task.cancelled():  # cancelled before its send: never sent
            continue
        res = task.result()
        out.append(Sent(i, arrivals[i], res, cutoff if res.status == "cancelled" else math.nan))
    return out, time.monotonic() - t0
