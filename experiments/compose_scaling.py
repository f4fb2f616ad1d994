"""Experiment `compose_scaling`: time to first token, full prefill vs transplant vs the limit.

For each skill length L a skill block of exactly L tokens is precompiled (prefilled alone and
saved to the store), and the paths to the first token of a question are timed side by side in
one process, alternating their order every repeat:

* full prefill: skill + question after the cached system prefix, O(L^2) attention + O(L) MLP
  (the shared system prefix is cached on every path, as a server would keep it);
* transplant: load the block from the store (mmap, content hash checked) inside the timed
  region, rotate its keys by the prefix length into a buffer after the cached system prefix,
  then the `seam` repaired tokens and the question in one forward (compose.transplant_extend);
* the limit: only the question against an already cached prefix + skill context, forwarded
  three ways: by transformers alone over its own DynamicCache (path `limit`, carrying none of
  kvnotes' call path; the cache is rebuilt untimed before each call), by kvnotes' extend
  (path `limit_engine`, which copies the cache into buffers with room first) and by
  `run.extend_into` over buffers that already hold the context (path `limit_inplace`: no copy,
  as a server keeps its cache). The limit is the fastest of them (`limit_path`); kvnotes.engine.limit
  says why.

speedup = full / transplant, limit_speedup = full / limit; a transplant can only approach the
limit (it adds the load, one rotation per layer and the seam tokens). Every timed region is
device-synchronised, with a warm allocator (on CPU glibc keeps freed memory for reuse:
kvnotes.measure.timing.keep_freed_memory, `malloc` in the records); peak memory comes from one more,
untimed round per path: torch.cuda.max_memory_allocated on CUDA, the rise of the process' peak
RSS on CPU (Linux clear_refs). Medians over repeats, with bootstrap CIs of the per-repeat paired
ratios.

    python -m experiments.run +experiment=compose_scaling model=llama device=cpu
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from experiments.shared.gate import GateConfig, gate_summary, run_gate
from experiments.shared.skill_prompts import question_ids, skill_ids
from kvnotes.compose import splice as compose
from kvnotes.compose.store import block_path, load_block, save_block
from kvnotes.engine import run as engine
from kvnotes.engine.cache import buffers
from kvnotes.engine.limit import bare_cache, bare_forward
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import ci_dict, logit_cosine
from kvnotes.measure.timing import keep_freed_memory, timed, torch_threads
from kvnotes.measure.timing import measure as timed_measure

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.models import LoadedModel

log = logging.getLogger(__name__)
# The paper's TTFT speedups (Qwen3-8B, GPU), by approximate skill length in tokens.
PAPER_SPEEDUP = {500: 1.16, 2000: 3.01, 8000: 9.8, 16000: 10.58, 32000: 13.93}


PROMPT_AROUND = 128  # tokens of system prefix + question around the skill block (bound; see question_ids)


@dataclass
class ComposeScalingConfig:
    """Skill lengths (tokens), repeats per path, the seam of the headline transplant."""

    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8000])
    repeats: int = 3  # timed rounds per length; each round runs every path once
    seam: int = 4  # seam repair of the headline transplant path
    extra_seams: list[int] = field(default_factory=lambda: [0])  # also timed (transplant@K)
    skill: str = "refund"  # kvnotes.tasks.skills name: header, rule and guidelines
    store_dir: str | None = None  # None: <run dir>/store
    keep_store: bool = False  # keep the block files after a length is measured
    threads: int | None = None  # torch CPU threads while timing (None: leave as is); 1 is
    # steadier than 2 on a CPU shared with other jobs (no spinning at OpenMP barriers)
    gate: GateConfig = field(default_factory=GateConfig)
    n_boot: int = 1000

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 16 for n in self.lengths):
            raise ConfigError(f"lengths must be a non-empty list of ints >= 16, got {self.lengths}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.seam < 0 or any(k < 0 for k in self.extra_seams):
            raise ConfigError("seams must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or null, got {self.threads}")

    def longest_prompt(self) -> tuple[str, int, int]:
        """The longest skill block with the system prefix and question around it (at most
        PROMPT_AROUND tokens: 69 + 43 with SmolLM2's chat frame), for the position check."""
        return "lengths", max(self.lengths), PROMPT_AROUND


# --- memory and timing ------------------------------------------------------------------------


def measure(fn: Callable[[], Any], device: Any = None, memory: bool = True) -> tuple[Any, float, float]:
    """(result, seconds, peak memory rise in MB during fn; NaN when not measured).

    The device is synchronised at both ends; peak memory is torch.cuda.max_memory_allocated on
    CUDA and the rise of the peak RSS (clear_refs) on CPU (kvnotes.measure.timing.measure), which first
    hands freed memory back to the OS: so the timed rounds run without it (`memory=False`, a warm
    allocator) and each path's peak comes from one more, untimed round.
    """

    return timed_measure(fn, device, memory=memory)


def cache_mb(cache: Any) -> float:
    return sum(t.numel() * t.element_size() for t in cache.keys + cache.values) / 2**20


# --- the paths ------------------------------------------------------------------------------


def one_length(
    model: LoadedModel, cfg: ComposeScalingConfig, length: int, store: Path, chat: bool, seed: int
) -> list[dict[str, Any]]:
    """Every path `cfg.repeats` times for one skill length, order rotated per repeat.

    Repeat 0 runs the full prefill first; its cache, cut before the question, is the limit's
    already cached context (so the limit reads exactly the full recompute's K/V).
    """

    tok = model.tokenizer
    prefix, question = question_ids(tok, cfg.skill, chat)
    block = skill_ids(tok, cfg.skill, length, seed)
    path = block_path(store, f"{cfg.skill}-L{length}")
    with timed(model.device) as clock:
        save_block(path, model, compose.prefill_block(model, block), name=f"{cfg.skill}-L{length}")
    precompile_s = clock.seconds
    prefix_cache = engine.prefill(model, prefix).cache  # the cached system prompt, common to all
    static = {"length": length, "prefix_len": len(prefix), "question_len": len(question),
              "store_mb": path.stat().st_size / 2**20, "precompile_s": precompile_s}
    engine.extend(model, prefix_cache, question)  # warm the kernels at this shape class
    parts: dict[str, float] = {}
    state: dict[str, Any] = {}

    def full() -> torch.Tensor:
        step = engine.extend(model, prefix_cache, block + question)
        if "context" not in state:  # the limit's already cached context: prefix + skill
            state["context"] = step.cache.slice(0, len(prefix) + len(block))
        return step.logits[0, -1]

    def transplant(seam: int) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            with timed(model.device) as clock:
                blk = load_block(path, model)
            parts["load_s"] = clock.seconds
            with timed(model.device) as clock:
                logits = compose.transplant_extend(model, prefix_cache, blk, seam, question).logits[0, -1]
            parts["splice_question_s"] = clock.seconds
            return logits
        return go

    question_t = torch.tensor([question], device=model.device)

    def limit() -> torch.Tensor:
        return bare_forward(model, state.pop("bare"), question_t)

    def limit_engine() -> torch.Tensor:
        return engine.extend(model, state["context"], question).logits[0, -1]

    def limit_inplace() -> torch.Tensor:
        keys, values = state["held"]
        return engine.extend_into(model, keys, values, state["context"].seq_len, question).logits[0, -1]

    paths: list[tuple[str, int | None, Callable[[], torch.Tensor]]] = [
        ("full", None, full), ("transplant", cfg.seam, transplant(cfg.seam)), ("limit", None, limit),
        ("limit_engine", None, limit_engine), ("limit_inplace", None, limit_inplace),
        *[("transplant", k, transplant(k)) for k in cfg.extra_seams if k != cfg.seam],
    ]

    def prepare(name: str) -> None:  # untimed, before a path runs
        parts.clear()
        if name == "limit":  # a forward extends a DynamicCache in place: a fresh one, untimed
            state["bare"] = bare_cache(state["context"])
        if name == "limit_inplace" and "held" not in state:  # built once: its scratch is reused
            state["held"] = buffers(state["context"], len(question), 1, model.device)

    rows: list[dict[str, Any]] = []
    ref: torch.Tensor | None = None
    # Interleaved rounds with an untimed `prepare` before each call and each call's logits kept:
    # not torch.utils.benchmark.Timer's case (one statement back to back, results discarded).
    for r in range(cfg.repeats):
        order = paths[r % len(paths):] + paths[: r % len(paths)]
        for name, seam, fn in order:
            prepare(name)
            logits, seconds, _ = measure(fn, model.device, memory=False)
            if name == "full" and ref is None:
                ref = logits
            rows.append({"kind": "timing", "path": name, "seam": -1 if seam is None else seam,
                         "repeat": r, "seconds": seconds,
                         "first_token": int(logits.argmax()), "logits": logits, **parts, **static})
            del logits
    for name, seam, fn in paths:  # each path's peak memory: one more round, untimed
        prepare(name)
        _, _, peak = measure(fn, model.device, memory=True)
        for row in rows:
            if row["path"] == name and row["seam"] == (-1 if seam is None else seam):
                row["peak_mb"] = peak
    assert ref is not None
    kv_mb = cache_mb(state["context"])
    for row in rows:  # memory, and each path's first-token logits against the full prefill
        row["kv_mb"] = kv_mb
        lg = row.pop("logits")
        row["cosine"] = float(logit_cosine(lg, ref))
        row["first_token_agree"] = bool(row["first_token"] == int(ref.argmax()))
    if not cfg.keep_store:
        path.unlink(missing_ok=True)
    return rows


# --- summary ----------------------------------------------------------------------------------


def paper_speedup(length: int) -> float | None:
    """The paper's speedup at a length within 10 % of this one, if it reports one."""
    near = [v for n, v in PAPER_SPEEDUP.items() if abs(n - length) <= 0.1 * n]
    return near[0] if near else None


def summarize(records: list[dict[str, Any]], cfg: ComposeScalingConfig) -> dict[str, Any]:
    """Per length: medians of the paths, speedups with CIs, memory, fidelity, targets."""
    df = pd.DataFrame(records)
    out: dict[str, Any] = {"gate": gate_summary(df, cfg.gate), "seam": cfg.seam, "lengths": {}}
    t = df[df["kind"] == "timing"] if "kind" in df.columns else df.iloc[:0]
    for length, g in t.groupby("length"):
        def sel(path: str, seam: int = -1, g: pd.DataFrame = g) -> pd.DataFrame:
            return g[(g["path"] == path) & (g["seam"] == seam)].sort_values("repeat")

        full, tp, bare, eng = sel("full"), sel("transplant", cfg.seam), sel("limit"), sel("limit_engine")
        inplace = sel("limit_inplace")
        # the limit is the fastest question-only forward timed (kvnotes.engine.limit)
        timed_ways = {k: v for k, v in (("bare", bare), ("engine", eng), ("inplace", inplace)) if len(v)}
        path = min(timed_ways, key=lambda k: float(timed_ways[k]["seconds"].median()))
        lim = timed_ways[path]
        f, x, m = (s["seconds"].to_numpy() for s in (full, tp, lim))
        n = min(len(f), len(x), len(m))
        row: dict[str, Any] = {
            "full_prefill_s": float(np.median(f)), "transplant_s": float(np.median(x)),
            "limit_s": float(np.median(m)), "limit_path": path,
            "limit_bare_s": float(bare["seconds"].median()),
            "limit_engine_s": float(eng["seconds"].median()) if len(eng) else None,
            "limit_inplace_s": float(inplace["seconds"].median()) if len(inplace) else None,
            "speedup": float(np.median(f) / np.median(x)),
            "limit_speedup": float(np.median(f) / np.median(m)),
            "speedup_ci": ci_dict(f[:n] / x[:n], cfg.n_boot),
            "limit_speedup_ci": ci_dict(f[:n] / m[:n], cfg.n_boot),
            "speedup_min": float(f.min() / x.min()), "limit_speedup_min": float(f.min() / m.min()),
            "n_repeats": int(n),
            "transplant_parts_s": {k: float(tp[k].median()) for k in ("load_s", "splice_question_s")},
            "peak_mb": {"full": float(full["peak_mb"].median()), "transplant": float(tp["peak_mb"].median()),
                        "limit": float(lim["peak_mb"].median())},
            "kv_mb": float(g["kv_mb"].iloc[0]), "store_mb": float(g["store_mb"].iloc[0]),
            "precompile_s": float(g["precompile_s"].iloc[0]),
            "transplant_cosine": float(tp["cosine"].mean()),
            "transplant_first_token_agree": float(tp["first_token_agree"].mean()),
        }
        row["fraction_of_limit"] = row["speedup"] / row["limit_speedup"]
        for k in sorted(set(g.loc[g["path"] == "transplant", "seam"]) - {cfg.seam}):
            e = sel("transplant", int(k))
            row[f"transplant_s@{int(k)}"] = float(e["seconds"].median())
            row[f"speedup@{int(k)}"] = float(np.median(f) / e["seconds"].median())
            row[f"transplant_cosine@{int(k)}"] = float(e["cosine"].mean())
        paper = paper_speedup(int(length))
        row["paper_speedup"] = paper
        row["meets_targets"] = bool((paper is None or row["speedup"] > paper)
                                    and row["fraction_of_limit"] >= 2 / 3)
        out["lengths"][str(int(length))] = row
    return out


def run(ctx: Context) -> None:
    cfg: ComposeScalingConfig = ctx.params
    store = Path(cfg.store_dir) if cfg.store_dir else ctx.run_dir / "store"
    chat = ctx.chat
    malloc = "keep" if ctx.model.device.type == "cpu" and keep_freed_memory() else "default"
    log.info("compose_scaling on %s, %s, %s threads, malloc %s", ctx.model.device, ctx.model.dtype,
             cfg.threads or torch.get_num_threads(), malloc)
    units = {f"L-{n:06d}": n for n in sorted(set(cfg.lengths))}
    with torch_threads(cfg.threads):
        run_gate(ctx, cfg.gate)
        for key in ctx.pending(list(units), desc="lengths"):
            rows = one_length(ctx.model, cfg, units[key], store, chat, ctx.cfg.seed)
            ctx.write(key, [{**r, "threads": torch.get_num_threads(), "malloc": malloc,
                             "device": str(ctx.model.device)} for r in rows])


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "compose_scaling"
CONFIG = ComposeScalingConfig
HELP = "TTFT of full prefill vs transplant vs the limit (question only), per skill length"
