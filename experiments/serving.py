"""Experiment `serving`: append-only erratum vs in-prefix edit under vLLM's automatic prefix cache.

A gated task item rendered with the chat template is the live context on a vLLM server with
prefix caching; a request sets its field to a value and reaches the model as an in-prefix edit
(with a fresh request id: every request a new state), an in-prefix edit of the field only
(edit_field: the item's own text, repeated once both values have been sent), an appended
erratum, or the field hoisted before the request (serving/prompts.py). Phases:

* items: for each of `n_items` items, its live context is prefilled (and its decision read),
  then each decision variant x value is sent once, one at a time: P(correct) of the served
  decision per variant and value over items, Wilson 95 %;
* sequential: `n_sequential` requests per variant on one item; the median edit latency S is
  the in-prefix edit's service time;
* poisson: seeded Poisson arrivals at rates the edit sustains (`rates`, else utilization/S),
  no cap, so no request is censored; sent by vLLM's own `vllm bench serve` (our prompts as its
  custom dataset; serving/bench.py) unless `poisson_driver=client`;
* overload: one rate above what the edit sustains (`overload_factor`/S), capped at
  `max_phase_s`: requests open at the cap are cancelled and counted as censored at their lower
  bound, so the edit's TTFT quantiles and the ratios against them are lower bounds. This
  phase keeps our httpx driver: bench serve waits for every request and cannot cut or count them.

Hit rate: delta of vLLM's prefix-cache counters (hit / queried tokens) per request where
requests run one at a time, per phase under load. Every phase starts from a warm server
(the variant's live context sent first, not counted). Paper (vLLM, Qwen3-8B, 8,066 tokens):
hit rate 0.985 vs 0.010, p90 TTFT 53-398x lower.

    bash scripts/serving_env.sh && python -m experiments.run +experiment=serving model=qwen-1.5b
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes import tasks
from kvnotes.edit.strategies import ERRATA
from kvnotes.errors import ConfigError
from kvnotes.measure import timing
from serving import bench, client, server
from serving.prompts import (
    VALUES,
    VARIANTS,
    Prompts,
    decision_of,
    drop_line,
    request_at,
    request_id,
    set_line,
    which_of,
    with_request,
)
from serving.summary import service_time
from serving.summary import summarize as _summarize

if TYPE_CHECKING:
    from experiments.shared.context import Context

__all__ = ["CONFIG", "NAME", "Prompts", "ServingConfig", "decision_of", "drop_line", "request_at",
           "request_id", "run", "set_line", "summarize", "which_of", "with_request"]
log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
PHASE_NUMBER = {"items": 0, "sequential": 1, "overload": 90}  # poisson i: 2 + i (request ids)


SERVED_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ServingConfig:
    url: str | None = None  # an already running server; None: start one from `python`
    python: str = ".venv-serving/bin/python"  # has vllm (scripts/serving_env.sh); relative: repo
    startup_timeout_s: float = 900.0
    enforce_eager: bool = True  # CPU: ~1 min start-up instead of ~2 (no torch.compile)
    kv_cache_gib: float = 4.0  # VLLM_CPU_KVCACHE_SPACE
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: all CPUs of this process
    block_size: int = 32
    # auto: bf16 where the device computes bf16 natively, else fp32 (kvnotes.measure.timing.native_bf16).
    # Measured with benchmarks/serving_dtype.py, qwen-1.5b, 2k-token prompt, TTFT: on a CPU with
    # native bf16, 19.8 s bf16 vs 36.9 s fp32 (median of 4); on an AVX2-only CPU, ~285 s bf16
    # (emulated) vs 59.3 s fp32 (median of 2)
    dtype: str = "auto"
    max_model_len: int = 8192
    extra_args: list[str] = field(default_factory=list)  # more vLLM server flags
    suite: str = "gated"
    length: int = 2000  # prompt tokens of each context (hit rate grows with it, so does the edit's cost)
    wording: str = "explicit"  # erratum wording (kvnotes.edit.strategies.ERRATA)
    max_tokens: int = 4  # generated tokens: the decision is the first word
    n_items: int = 24  # items phase: decisions over this many items (0: none)
    decision_variants: list[str] = field(default_factory=lambda: ["edit", "erratum"])
    decision_values: list[str] = field(default_factory=lambda: list(VALUES))
    item_index: int = 0  # which item is the live context of the sequential/poisson/overload phases
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    n_sequential: int = 4  # per variant, one at a time
    rates: list[float] = field(default_factory=list)  # sustained Poisson rates, req/s; []: derived
    utilizations: list[float] = field(default_factory=lambda: [0.5])  # derived rates: u / S
    overload_factor: float = 3.0  # overload rate = factor / S (offered load of the edit)
    overload_rate: float | None = None  # req/s; None: derived from overload_factor
    overload: bool = True
    n_poisson: int = 12  # requests per variant and rate
    max_phase_s: float = 240.0  # overload cap: no sends after it, open requests cancelled
    poisson_driver: str = "bench"  # bench: `vllm bench serve`; client: our httpx driver
    request_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        for key, allowed, need in (("variants", VARIANTS, "edit"), ("decision_variants", VARIANTS, "edit"),
                                   ("decision_values", VALUES, "new")):
            got = getattr(self, key)
            if any(v not in allowed for v in got) or need not in got:
                raise ValueError(f"{key} must include {need} and be among {', '.join(allowed)}; got {got}")
        if self.wording not in ERRATA:
            raise ValueError(f"wording {self.wording!r}; valid: {', '.join(ERRATA)}")
        if self.length < 64 or self.length + 128 > self.max_model_len:
            raise ValueError(f"need 64 <= length <= max_model_len - 128, got {self.length}")
        if min(self.n_sequential, self.n_poisson, self.n_items, self.item_index) < 0:
            raise ValueError("n_sequential, n_poisson, n_items and item_index must be >= 0")
        if any(not r > 0 for r in self.rates) or any(not 0 < u < 1 for u in self.utilizations):
            raise ValueError("rates > 0; utilizations in (0, 1): a sustained rate keeps the edit below saturation")
        if not self.overload_factor > 1 or (self.overload_rate is not None and not self.overload_rate > 0):
            raise ValueError("overload_factor > 1 (offered load of the edit), overload_rate > 0")
        derived = self.n_poisson > 0 and (not self.rates and self.utilizations or
                                          self.overload and self.overload_rate is None)
        if derived and self.n_sequential < 1:
            raise ValueError("derived rates need the edit's service time: n_sequential >= 1, or give "
                             "rates and overload_rate")
        if self.max_tokens < 1 or self.max_phase_s <= 0 or self.block_size < 1:
            raise ValueError("max_tokens >= 1, max_phase_s > 0, block_size >= 1")
        if self.dtype not in SERVED_DTYPES:
            raise ValueError(f"dtype {self.dtype!r}; valid: {', '.join(SERVED_DTYPES)}")
        if self.poisson_driver not in ("bench", "client"):
            raise ValueError(f"poisson_driver {self.poisson_driver!r}; valid: bench, client")

    def sustained(self, service_s: float) -> list[float]:
        """Poisson rates (req/s) the edit sustains: `rates`, else utilization / service time."""
        return list(self.rates) or [_sig(u / service_s) for u in self.utilizations]

    def overload_at(self, service_s: float) -> float:
        return self.overload_rate or _sig(self.overload_factor / service_s)

    def longest_prompt(self) -> tuple[str, int, int]:
        """A context of `length` tokens with the erratum, request and generated tokens after it
        (the 128 tokens `max_model_len` reserves), for the position check."""
        return "length", self.length, 128


def _sig(x: float, digits: int = 3) -> float:
    if not math.isfinite(x) or x <= 0:
        raise RuntimeError(f"no usable edit service time for derived rates (got rate {x})")
    return float(f"{x:.{digits}g}")


# --- one server session: the requests and their records -------------------------------------


@dataclass
class _Session:
    url: str
    name: str
    cfg: ServingConfig
    tokenizer: str  # HF folder (bench serve counts tokens with it)
    run_dir: Path
    startup_s: float
    dtype: str = ""  # vLLM's --dtype (served_dtype)
    seen: set[str] = field(default_factory=set)  # digests of the prompts this server was sent

    def first_seen(self, text: str) -> bool:
        d = hashlib.sha1(text.encode()).hexdigest()
        new = d not in self.seen
        self.seen.add(d)
        return new

    def body(self, prompt: str, max_tokens: int | None = None) -> dict[str, Any]:
        return {"model": self.name, "prompt": prompt, "temperature": 0.0,
                "max_tokens": max_tokens or self.cfg.max_tokens}

    def one(self, prompt: str, max_tokens: int | None = None
            ) -> tuple[client.Completion, client.Counters, client.Counters, bool]:
        """A request on an idle server: its result, the counters before and after, whether new."""
        first = self.first_seen(prompt)
        before = client.wait_idle(self.url, timeout=self.cfg.request_timeout_s)
        res = client.complete_one(self.url, self.body(prompt, max_tokens), self.cfg.request_timeout_s)
        return res, before, client.wait_idle(self.url, timeout=self.cfg.request_timeout_s), first

    def sequence(self, texts: Sequence[str]
                 ) -> tuple[list[tuple[client.Sent, dict[str, float], bool]], float, dict[str, float]]:
        """`texts` one at a time: per request (sent, its counter deltas, new?), the wall time,
        and the counter deltas over all of them (hit rate, the server's TTFT)."""
        t0 = time.monotonic()
        out, snaps = [], []
        for i, text in enumerate(texts):
            at = time.monotonic() - t0
            res, before, after, first = self.one(text)
            out.append((client.Sent(i, at, res), after - before, first))
            snaps += [before, after]
        return out, time.monotonic() - t0, (snaps[-1] - snaps[0]) if snaps else {}

    def warm(self, prompt: str) -> None:
        res, _, _, _ = self.one(prompt, max_tokens=1)
        if res.status != "ok":
            raise RuntimeError(f"warm-up request failed: {res.error}")

    def load(self, key: str, texts: Sequence[str], rate: float, seed: int, cap: float,
             driver: str) -> tuple[list[client.Sent], float]:
        if driver == "bench":
            spec = bench.BenchSpec(_python(self.cfg), self.url, self.name, self.tokenizer, rate, seed,
                                   self.cfg.max_tokens)
            timeout = 300 + 3 * len(texts) / rate + self.cfg.request_timeout_s
            return bench.run(spec, texts, self.run_dir / "bench" / key, self.run_dir / "bench.log", timeout)
        bodies = [self.body(t) for t in texts]
        return client.run_load(self.url, bodies, client.poisson_arrivals(rate, len(texts), seed), cap,
                               self.cfg.request_timeout_s)


def _row(p: Prompts, s: client.Sent, which: str, rid: str, text: str, first: bool,
         delta: dict[str, float] | None, base: dict[str, Any]) -> dict[str, Any]:
    """One request's record; every record has the same keys (NaN where not measured)."""
    r = s.result
    lower = r.ttft_s if not math.isnan(r.ttft_s) else (s.cutoff_s - s.arrival_s if r.status == "cancelled" else math.nan)
    decision = decision_of(r.text, p.item.outcomes) if r.status == "ok" else ""
    d = delta or {}
    return base | {
        "item_id": p.item.item_id, "index": s.index, "value": which, "field_value": p.value(which),
        "request_id": rid, "arrival_s": s.arrival_s, "ttft_s": r.ttft_s, "ttft_lower_s": lower,
        "latency_s": r.latency_s, "end_s": s.arrival_s + r.latency_s, "status": r.status, "error": r.error,
        "text": r.text, "decision": decision, "expected": p.expected(which),
        "correct": decision == p.expected(which), "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens, "cached_tokens": r.cached_tokens,
        "hit_tokens": d.get("hit_tokens", math.nan), "query_tokens": d.get("query_tokens", math.nan),
        "request_hit_rate": d.get("hit_rate", math.nan), "first_seen": first, "prompt_chars": len(text),
    }


def _base(phase: str, variant: str, item_index: int, rate: float, load: float, driver: str,
          wall: float, n: int, counts: dict[str, float], sess: _Session) -> dict[str, Any]:
    return {"phase": phase, "variant": variant, "item_index": item_index, "rate": rate,
            "offered_load": load, "driver": driver, "wall_s": wall, "n_planned": n,
            "served_model": sess.name, "length": sess.cfg.length, "startup_s": sess.startup_s,
            "served_dtype": sess.dtype, **{f"phase_{k}": v for k, v in counts.items()}}


def items_unit(sess: _Session, p: Prompts, j: int) -> list[dict[str, Any]]:
    """Item j: its live context prefilled (variant `live`, value old), then each decision variant
    and value once, one at a time."""
    cfg = sess.cfg
    live, before, after, first = sess.one(p.item.old_text)
    plan = [(v, w) for v in cfg.decision_variants for w in cfg.decision_values]
    rids = [request_id(PHASE_NUMBER["items"], 20 * j + m + 1) for m in range(len(plan))]
    texts = [p.build(v, w, rid) for (v, w), rid in zip(plan, rids)]
    sent, wall, counts = sess.sequence(texts)  # counts: over the decision requests, not `live`
    rows = [_row(p, client.Sent(0, 0.0, live), "old", "", p.item.old_text, first, after - before,
                 _base("items", "live", j, math.nan, math.nan, "client", live.latency_s, 1, counts, sess))]
    for (s, d, f), (v, w), rid, text in zip(sent, plan, rids, texts):
        s.index += 1
        rows.append(_row(p, s, w, rid, text, f, d,
                         _base("items", v, j, math.nan, math.nan, "client", wall, len(plan), counts, sess)))
    return rows


def sequential_unit(sess: _Session, p: Prompts, variant: str, j: int) -> list[dict[str, Any]]:
    k = PHASE_NUMBER["sequential"]
    sess.warm(p.warm(variant))
    texts = [p.build(variant, which_of(i), request_id(k, i)) for i in range(sess.cfg.n_sequential)]
    sent, wall, counts = sess.sequence(texts)
    base = _base("sequential", variant, j, math.nan, math.nan, "client", wall, len(texts), counts, sess)
    return [_row(p, s, which_of(s.index), request_id(k, s.index), texts[s.index], f, d, base) for s, d, f in sent]


def load_unit(sess: _Session, p: Prompts, variant: str, j: int, k: int, key: str, rate: float,
              service_s: float, seed: int) -> list[dict[str, Any]]:
    """A Poisson phase (k >= 2: sustained, no cap) or the overload phase (capped, censored)."""
    cfg = sess.cfg
    overload = k == PHASE_NUMBER["overload"]
    sess.warm(p.warm(variant))
    before = client.wait_idle(sess.url, timeout=cfg.request_timeout_s)
    texts = [p.build(variant, which_of(i), request_id(k, i)) for i in range(cfg.n_poisson)]
    first = [sess.first_seen(t) for t in texts]
    driver = "client" if overload else cfg.poisson_driver
    sent, wall = sess.load(key, texts, rate, seed, cfg.max_phase_s if overload else math.inf, driver)
    counts = client.wait_idle(sess.url, timeout=cfg.request_timeout_s) - before
    base = _base("overload" if overload else "poisson", variant, j, rate, rate * service_s, driver, wall,
                 len(texts), counts, sess)
    return [_row(p, s, which_of(s.index), request_id(k, s.index), texts[s.index], first[s.index], None, base)
            for s in sent]


# --- the job -----------------------------------------------------------------------------------


def _python(cfg: ServingConfig) -> str:
    python = Path(cfg.python)
    python = python if python.is_absolute() else ROOT / python
    if not python.exists():
        raise ConfigError(f"experiment.python={cfg.python!r}: {python} not found; create the server env "
                          "with `bash scripts/serving_env.sh`, or give experiment.url")
    return str(python)


def served_dtype(ctx: Context, cfg: ServingConfig) -> str:
    """vLLM's --dtype: the configured one, or (auto) bfloat16 where the run's device computes bf16
    natively and float32 where it would be emulated (vLLM's CPU bf16 kernels: ~5x slower there)."""
    if cfg.dtype != "auto":
        return cfg.dtype

    pick = "bfloat16" if timing.native_bf16(ctx.model.device) else "float32"
    log.info("served dtype auto on %s: %s", ctx.model.device, pick)
    return pick


def _server_spec(ctx: Context, cfg: ServingConfig) -> server.ServerSpec:
    python = _python(cfg)
    if not ctx.model.source_path:
        raise ValueError(f"model {ctx.model.name} has no HF folder to serve")
    return server.ServerSpec(
        python=python, model_path=str(ctx.model.source_path), served_name=ctx.model.name,
        max_model_len=cfg.max_model_len, block_size=cfg.block_size, dtype=served_dtype(ctx, cfg),
        kv_cache_gib=cfg.kv_cache_gib, cpu_bind=cfg.cpu_bind, enforce_eager=cfg.enforce_eager,
        extra_args=list(cfg.extra_args))


def run(ctx: Context) -> None:

    cfg: ServingConfig = ctx.params
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    items = tasks.build_suite(cfg.suite, ctx.model.tokenizer, chat=ctx.chat,
                              n_items=max(cfg.n_items, cfg.item_index + 1), length=cfg.length,
                              seed=ctx.cfg.seed)
    j = cfg.item_index
    main = Prompts(items[j], cfg.wording)
    seq = [f"sequential-{v}" for v in cfg.variants] if cfg.n_sequential else []
    per_item = [f"items-{i:03d}" for i in range(cfg.n_items)]
    n_rates = len(cfg.rates or cfg.utilizations) if cfg.n_poisson else 0
    pois = [f"poisson{i}-{v}" for i in range(n_rates) for v in cfg.variants]
    over = [f"overload-{v}" for v in cfg.variants] if cfg.n_poisson and cfg.overload else []
    if all(ctx.done(key) for key in seq + per_item + pois + over):
        return
    if cfg.poisson_driver == "bench" and not all(ctx.done(key) for key in pois):
        why = bench.missing(_python(cfg))  # bench serve runs from the vLLM venv, also against a url
        if why:
            raise ConfigError(f"experiment.poisson_driver=bench: {why}")
    with _server(ctx, cfg) as (url, startup_s):
        sess = _Session(url, client.served_models(url)[0], cfg, str(ctx.model.source_path or ""),
                        ctx.run_dir, startup_s, served_dtype(ctx, cfg))
        for key in ctx.pending(seq, desc="sequential"):
            ctx.write(key, sequential_unit(sess, main, key.split("-", 1)[1], j))
        service_s = service_time(ctx.read().to_dict("records")) if seq else math.nan
        log.info("edit service time S = %.1f s (median sequential edit latency)", service_s)
        for key in ctx.pending(per_item, desc="items"):
            i = int(key.split("-")[1])
            ctx.write(key, items_unit(sess, Prompts(items[i], cfg.wording), i))
        rates = cfg.sustained(service_s) if pois else []
        if pois:
            log.info("poisson rates %s req/s: ~%.0f s of arrivals per variant", rates,
                     sum(cfg.n_poisson / r for r in rates))
        for key in ctx.pending(pois, desc="poisson"):
            i, variant = int(key[len("poisson"):key.index("-")]), key.split("-", 1)[1]
            ctx.write(key, load_unit(sess, main, variant, j, 2 + i, key, rates[i], service_s,
                                     seed=ctx.cfg.seed * 1000 + 2 + i))
        for key in ctx.pending(over, desc="overload"):
            k = PHASE_NUMBER["overload"]
            ctx.write(key, load_unit(sess, main, key.split("-", 1)[1], j, k, key, cfg.overload_at(service_s),
                                     service_s, seed=ctx.cfg.seed * 1000 + k))


class _server:
    """`cfg.url` as is, or a server started now and always stopped: (url, start-up seconds)."""

    def __init__(self, ctx: Context, cfg: ServingConfig) -> None:
        self.ctx, self.cfg = ctx, cfg
        self.server: server.Server | None = None

    def __enter__(self) -> tuple[str, float]:
        if self.cfg.url:
            return self.cfg.url.rstrip("/"), math.nan
        spec = _server_spec(self.ctx, self.cfg)
        self.server = server.Server(spec, self.ctx.run_dir / "server.log", self.cfg.startup_timeout_s)
        log.info("starting vLLM on %s (log %s)", self.server.url, self.server.log_path)
        self.server.__enter__()
        log.info("vLLM ready in %.0f s", self.server.startup_s)
        return self.server.url, self.server.startup_s

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


def summarize(records: list[dict[str, Any]], cfg: ServingConfig) -> dict[str, Any]:
    """serving/summary.py: per variant and phase, the ratios and the decisions."""
    model = next((str(r["served_model"]) for r in records if r.get("served_model")), "the model")
    return _summarize(records, cfg.length, cfg.block_size, model)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "serving"
CONFIG = ServingConfig
HELP = "vLLM prefix cache: erratum vs in-prefix edit, decisions over items, TTFT, hit rate"
