"""Experiment `serving`: append-only erratum vs in-prefix edit under vLLM's automatic prefix cache.

One long agent context (a gated task item of `length` tokens, rendered with the chat template)
is live on the server. Request i changes the gating field to value v_i (new, old, new, ...) and
carries a fresh request id, sent three ways over /v1/completions (stream=true, temperature 0):

* edit: the prompt re-rendered with the state in place (field = v_i, session request_id = id_i),
  so every block from the session block on is new to the cache;
* erratum: the live context byte for byte, then `[STATE UPDATE] <field> has changed to v_i; ...`
  before the request line, so every full block before it hits;
* hoist: the field's line moved to just before the request (the prefix without it is shared).

All three carry the id in the request line (`Request (id_i): ...`), so no two requests are equal.
Sequential requests first, then seeded Poisson arrivals at each rate, each phase capped in count
and time (requests still open at the cap are cancelled; their TTFT is censored at the cap and
counted as that lower bound, so a capped quantile is a lower bound). Per variant and phase:
hit rate (delta of vLLM's prefix-cache counters), client p50/p90/p99 TTFT, throughput, the
server's TTFT histogram, and decision agreement with the edit (first generated word).
Paper (vLLM, Qwen3-8B, 8,066 tokens): hit rate 0.985 vs 0.010, p90 TTFT 53-398x lower.

    bash scripts/serving_env.sh && python -m experiments.run +experiment=serving model=llama
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments import _vllm_client as client
from experiments import _vllm_server as server
from kvnotes.edit_strategies import ERRATA, erratum_text
from kvnotes.errors import ConfigError
from kvnotes.tasks.item import TaskItem

if TYPE_CHECKING:
    from experiments._context import Context

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("edit", "erratum", "hoist")
REQUEST = "Request:"  # the request line of the task frame (kvnotes/tasks/templates/_banks.yaml)


@dataclass
class ServingConfig:
    url: str | None = None  # an already running server; None: start one from `python`
    python: str = ".venv-serving/bin/python"  # has vllm (scripts/serving_env.sh); relative: repo
    startup_timeout_s: float = 900.0
    enforce_eager: bool = True  # CPU: ~1 min start-up instead of ~2 (no torch.compile)
    kv_cache_gib: float = 4.0  # VLLM_CPU_KVCACHE_SPACE
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; None: all CPUs of this process
    block_size: int = 32
    dtype: str = "bfloat16"
    max_model_len: int = 8192
    extra_args: list[str] = field(default_factory=list)  # more vLLM server flags
    suite: str = "gated"
    item_index: int = 0  # which item of the suite is the live context
    length: int = 8000  # prompt tokens of the context (2k-8k; hit rate grows with it)
    wording: str = "explicit"  # erratum wording (kvnotes.edit_strategies.ERRATA)
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    max_tokens: int = 4
    n_sequential: int = 4  # per variant, one at a time
    rates: list[float] = field(default_factory=lambda: [0.1, 1.0])  # Poisson rates, req/s
    n_poisson: int = 16  # requests per variant and rate
    max_phase_s: float = 240.0  # cap per (variant, rate): no sends after it, open ones cancelled
    request_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or "edit" not in self.variants:
            raise ValueError(f"variants must include edit and be among {', '.join(VARIANTS)}; got {self.variants}")
        if self.wording not in ERRATA:
            raise ValueError(f"wording {self.wording!r}; valid: {', '.join(ERRATA)}")
        if self.length < 64 or self.length + 128 > self.max_model_len:
            raise ValueError(f"need 64 <= length <= max_model_len - 128, got {self.length}")
        if any(not r > 0 for r in self.rates) or min(self.n_sequential, self.n_poisson) < 0:
            raise ValueError("rates > 0, n_sequential >= 0, n_poisson >= 0")
        if self.max_tokens < 1 or self.max_phase_s <= 0 or self.block_size < 1:
            raise ValueError("max_tokens >= 1, max_phase_s > 0, block_size >= 1")


# --- prompts (text level; the server tokenizes) ----------------------------------------------


def set_line(text: str, key: str, value: str) -> str:
    """`text` with the value of its first `key: ...` line replaced (the line must exist)."""
    m = re.search(rf"(?m)^{re.escape(key)}:[^\n]*", text)
    if m is None:
        raise ValueError(f"no line '{key}:' in the prompt")
    return text[: m.start()] + f"{key}: {value}" + text[m.end():]


def drop_line(text: str, key: str) -> str:
    m = re.search(rf"(?m)^{re.escape(key)}:[^\n]*\n", text)
    if m is None:
        raise ValueError(f"no line '{key}:' in the prompt")
    return text[: m.start()] + text[m.end():]


def request_at(text: str) -> int:
    """Character offset of the request line (where the erratum goes, as in kvnotes.edit_strategies)."""
    at = text.rfind("\n" + REQUEST)
    if at < 0:
        raise ValueError(f"no '{REQUEST}' line in the prompt")
    return at + 1


def with_request(text: str, before: str, rid: str) -> str:
    """`before` inserted before the request line, which is tagged with the request id."""
    at = request_at(text)
    return text[:at] + before + f"Request ({rid}):" + text[at + len(REQUEST):]


@dataclass(frozen=True)
class Prompts:
    """The three ways of sending request (value, id) against one live context `item.old_text`."""

    item: TaskItem
    wording: str = "explicit"

    def value(self, which: str) -> str:
        return (self.item.new_value if which == "new" else self.item.old_value).strip()

    def edit(self, which: str, rid: str) -> str:
        base = self.item.new_text if which == "new" else self.item.old_text
        return with_request(set_line(base, "request_id", rid), "", rid)

    def erratum(self, which: str, rid: str) -> str:
        item = dataclasses.replace(self.item, new_value=self.value(which))
        return with_request(self.item.old_text, erratum_text(item, self.wording), rid)

    def hoist(self, which: str, rid: str) -> str:
        f = self.item.field_name
        return with_request(drop_line(self.item.old_text, f), f"{f}: {self.value(which)}\n", rid)

    def build(self, variant: str, which: str, rid: str) -> str:
        return {"edit": self.edit, "erratum": self.erratum, "hoist": self.hoist}[variant](which, rid)

    def warm(self, variant: str) -> str:
        """What the live session last sent: its prefix is what a running server has cached."""
        if variant == "hoist":
            f = self.item.field_name
            text = drop_line(self.item.old_text, f)
            at = request_at(text)
            return text[:at] + f"{f}: {self.value('old')}\n" + text[at:]
        return self.item.old_text

    def expected(self, which: str) -> str:
        return self.item.correct_new if which == "new" else self.item.correct_old


def decision_of(text: str, outcomes: Sequence[str]) -> str:
    """The outcome named by the first generated word (a truncated name counts), else the word."""
    m = re.search(r"[A-Za-z][A-Za-z0-9_\-]*", text)
    word = m.group(0) if m else ""
    hits = [o for o in outcomes if word and (o.startswith(word) or word.startswith(o))]
    return hits[0] if len(hits) == 1 else word


def which_of(i: int) -> str:
    return "new" if i % 2 == 0 else "old"


def request_id(phase: int, i: int) -> str:
    """6 digits: never equal to a task item's own 5-digit request id."""
    return f"RQ-{phase:02d}{i:04d}"


# --- driving the server ----------------------------------------------------------------------


def _request(url: str, name: str, prompt: str, cfg: ServingConfig, max_tokens: int | None = None
             ) -> client.StreamingRequest:
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens or cfg.max_tokens,
            "temperature": 0.0}
    return client.StreamingRequest(url, body, timeout=cfg.request_timeout_s)


def _phase(url: str, name: str, prompts: Prompts, cfg: ServingConfig, variant: str, k: int,
           rate: float | None, seed: int) -> list[dict[str, Any]]:
    """Warm the live context, snapshot the counters, send the phase's requests, snapshot again."""
    warm = _request(url, name, prompts.warm(variant), cfg, max_tokens=1).run()
    if warm.status != "ok":
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    before = client.wait_idle(url)
    texts = {i: prompts.build(variant, which_of(i), request_id(k, i))
             for i in range(cfg.n_sequential if rate is None else cfg.n_poisson)}
    t0 = time.monotonic()
    if rate is None:  # one at a time: arrival = when the previous one finished
        sent = []
        for i, text in texts.items():
            at = time.monotonic() - t0
            sent.append(client.Sent(i, at, _request(url, name, text, cfg).run()))
        wall = time.monotonic() - t0
    else:
        arrivals = client.poisson_arrivals(rate, len(texts), seed)
        sent, wall = client.run_load(lambda i: _request(url, name, texts[i], cfg), arrivals,
                                      cfg.max_phase_s)
    counts = client.wait_idle(url, timeout=cfg.request_timeout_s) - before
    phase = {"phase": "sequential" if rate is None else "poisson",
             "rate": math.nan if rate is None else rate, "variant": variant, "wall_s": wall,
             "n_planned": len(texts), **{f"phase_{key}": v for key, v in counts.items()}}
    rows = []
    for s in sent:
        r, which = s.result, which_of(s.index)
        first = not math.isnan(r.ttft_s)
        lower = r.ttft_s if first else (s.cutoff_s - s.arrival_s if r.status == "cancelled" else math.nan)
        decision = decision_of(r.text, prompts.item.outcomes) if r.status == "ok" else ""
        rows.append(phase | {
            "index": s.index, "value": which, "field_value": prompts.value(which),
            "request_id": request_id(k, s.index), "arrival_s": s.arrival_s,
            "ttft_s": r.ttft_s, "ttft_lower_s": lower, "latency_s": r.latency_s,
            "end_s": s.arrival_s + r.latency_s, "status": r.status, "error": r.error,
            "text": r.text, "decision": decision, "expected": prompts.expected(which),
            "correct": decision == prompts.expected(which), "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens, "prompt_chars": len(texts[s.index]),
        })
    return rows


def _server_spec(ctx: Context, cfg: ServingConfig) -> server.ServerSpec:
    python = Path(cfg.python)
    python = python if python.is_absolute() else ROOT / python
    if not python.exists():
        raise ConfigError(f"experiment.python={cfg.python!r}: {python} not found; create the server env "
                          "with `bash scripts/serving_env.sh`, or give experiment.url")
    if not ctx.model.source_path:
        raise ValueError(f"model {ctx.model.name} has no HF folder to serve")
    return server.ServerSpec(
        python=str(python), model_path=str(ctx.model.source_path), served_name=ctx.model.name,
        max_model_len=cfg.max_model_len, block_size=cfg.block_size, dtype=cfg.dtype,
        kv_cache_gib=cfg.kv_cache_gib, cpu_bind=cfg.cpu_bind, enforce_eager=cfg.enforce_eager,
        extra_args=list(cfg.extra_args))


def run(ctx: Context) -> None:
    from kvnotes import tasks

    cfg: ServingConfig = ctx.params
    chat = ctx.chat
    items = tasks.build_suite(cfg.suite, ctx.model.tokenizer, chat=chat,
                              n_items=cfg.item_index + 1, length=cfg.length, seed=ctx.cfg.seed)
    prompts = Prompts(items[cfg.item_index], cfg.wording)
    phases: list[float | None] = [None, *cfg.rates] if cfg.n_sequential else list(cfg.rates)
    units = {f"{'seq' if r is None else f'rate{r:g}'}-{v}": (k, r, v)
             for k, r in enumerate(phases) for v in cfg.variants}
    todo = [key for key in units if not ctx.done(key)]
    if not todo:
        return
    with _server(ctx, cfg) as (url, startup_s):
        name = client.served_models(url)[0]
        for key in ctx.pending(list(units), desc="serving phases"):
            k, rate, variant = units[key]
            log.info("phase %s", key)
            rows = _phase(url, name, prompts, cfg, variant, k, rate,
                          seed=ctx.cfg.seed * 1000 + k)
            ctx.write(key, [r | {"item_id": prompts.item.item_id, "length": cfg.length,
                                 "startup_s": startup_s} for r in rows])


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


# --- summary ---------------------------------------------------------------------------------


def _q(values: Sequence[float], q: float) -> float:
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    return float(np.percentile(v, q)) if v.size else math.nan


def _stats(rows: Sequence[Mapping[str, Any]], edit: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    lower = [float(r["ttft_lower_s"]) for r in rows]
    ends = [float(r["end_s"]) for r in ok]
    censored = sum(r["status"] == "cancelled" for r in rows)
    span = max(ends) if not censored and ends else float(rows[0]["wall_s"])
    by_i = {r["index"]: r["decision"] for r in edit if r["status"] == "ok"}
    pairs = [(r["decision"], by_i[r["index"]]) for r in ok if r["index"] in by_i]
    first = rows[0]
    return {
        "n": len(rows), "n_ok": len(ok), "n_censored": censored,
        "n_error": sum(r["status"] == "error" for r in rows),
        "prompt_tokens": _q([float(r["prompt_tokens"]) for r in ok], 50),
        "hit_rate": float(first["phase_hit_rate"]),
        "ttft_p50_s": _q(lower, 50), "ttft_p90_s": _q(lower, 90), "ttft_p99_s": _q(lower, 99),
        "ttft_is_lower_bound": bool(censored),
        "latency_p50_s": _q([float(r["latency_s"]) for r in ok], 50),
        "throughput": len(ok) / span if span > 0 else math.nan,  # completed requests / s
        "server_ttft_mean_s": float(first["phase_server_ttft_mean_s"]),
        "server_ttft_p90_s": float(first["phase_server_ttft_p90_s"]),
        "decision_agreement": (sum(a == b for a, b in pairs) / len(pairs)) if pairs else math.nan,
        "n_agreement": len(pairs),
        "p_correct": (sum(bool(r["correct"]) for r in ok) / len(ok)) if ok else math.nan,
        "decisions": {w: sorted({r["decision"] for r in ok if r["value"] == w}) for w in ("new", "old")},
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) else math.nan


def summarize(records: list[dict[str, Any]], cfg: ServingConfig) -> dict[str, Any]:
    """Per variant and phase ('sequential' or the rate): the stats; per phase: edit/erratum ratios."""
    rows = list(records)
    phases: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        label = "sequential" if r["phase"] == "sequential" else f"{float(r['rate']):g}"
        phases.setdefault(label, {}).setdefault(r["variant"], []).append(r)
    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for label, by_v in phases.items():
        edit = by_v.get("edit", [])
        for v, rs in by_v.items():
            results.setdefault(v, {})[label] = _stats(sorted(rs, key=lambda r: r["index"]), edit)
        if "edit" in by_v:
            e = results["edit"][label]
            for v in by_v:
                if v != "edit":
                    s = results[v][label]
                    ratios.setdefault(v, {})[label] = {
                        "p50_ratio": _ratio(e["ttft_p50_s"], s["ttft_p50_s"]),
                        "p90_ratio": _ratio(e["ttft_p90_s"], s["ttft_p90_s"]),
                        "p99_ratio": _ratio(e["ttft_p99_s"], s["ttft_p99_s"]),
                        "throughput_ratio": _ratio(s["throughput"], e["throughput"]),
                    }
    edit_decisions = [r for r in rows if r["variant"] == "edit" and r["status"] == "ok"]
    by_value = {w: {r["decision"] for r in edit_decisions if r["value"] == w} for w in ("new", "old")}
    return {
        "item_id": rows[0]["item_id"] if rows else None, "length": cfg.length,
        # whether the model's decision under the in-prefix edit follows the field at all: if not,
        # decision agreement checks that the erratum leaves the decision alone, not that it flips it
        "field_sensitive": bool(by_value["new"] and by_value["old"] and by_value["new"] != by_value["old"]),
        "block_size": cfg.block_size, "startup_s": _q([float(r["startup_s"]) for r in rows], 50),
        "results": results, "ratios": ratios,
        "p90_ratio": {k: v["p90_ratio"] for k, v in ratios.get("erratum", {}).items()},
        "table": table(results, ratios),
    }


def table(results: Mapping[str, Mapping[str, Mapping[str, Any]]],
          ratios: Mapping[str, Mapping[str, Mapping[str, float]]]) -> list[str]:
    """Markdown lines: one row per variant and phase, then the edit/erratum ratios."""
    head = ("| variant | rate (req/s) | n (ok/censored) | prompt tokens | hit rate | TTFT p50 s "
            "| p90 s | p99 s | throughput req/s | agreement with edit | P(correct) |")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    order = {"sequential": -1.0}
    labels = sorted({lab for v in results.values() for lab in v}, key=lambda s: order.get(s, float(s) if s[0].isdigit() else 0))
    for lab in labels:
        for v in VARIANTS:
            s = results.get(v, {}).get(lab)
            if s is None:
                continue
            lb = "≥" if s["ttft_is_lower_bound"] else ""
            out.append(f"| {v} | {lab} | {s['n']} ({s['n_ok']}/{s['n_censored']}) | "
                       f"{s['prompt_tokens']:.0f} | {s['hit_rate']:.3f} | {lb}{s['ttft_p50_s']:.3f} | "
                       f"{lb}{s['ttft_p90_s']:.3f} | {lb}{s['ttft_p99_s']:.3f} | {s['throughput']:.3f} | "
                       f"{s['decision_agreement']:.2f} | {s['p_correct']:.2f} |")
    for v, by in ratios.items():
        for lab in labels:
            if lab in by:
                r = by[lab]
                out.append(f"edit/{v} at {lab}: p50 {r['p50_ratio']:.1f}x, p90 {r['p90_ratio']:.1f}x, "
                           f"p99 {r['p99_ratio']:.1f}x; throughput {v}/edit {r['throughput_ratio']:.1f}x")
    return out


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "serving"
CONFIG = ServingConfig
HELP = "vLLM prefix cache: erratum vs in-prefix edit, TTFT, hit rate, decisions"
