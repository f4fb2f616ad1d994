"""Experiment `blend`: cache-reuse methods head to head, on the same items, model and blocks.

Every block is prefilled alone once and RoPE-moved to where it lands; the head is cached. Per
item, against a full prefill of the same tokens: naive reuse; seam repair K (recompute the first
K tokens of every block: EPIC's LegoLink, the same method under both names); CacheBlend r (the r
% block tokens of largest key deviation at an early layer, recomputed against the reused
neighbours); attribution r (the block tokens whose early-layer deviation moves the answer most,
through the gradient at the naive splice); query-aware r (ProphetKV: the tokens the question
attends to most); note-aware repair r (each block's aggregator tokens, the paper's account as a
method, alone and with each block's first tokens bought first) at CacheBlend's budgets
(kvnotes.compose.blend); optionally kvboost as it ships, in its own venv
(experiments/shared/kvboost_worker.py). Workloads (experiments/shared/workloads.py): skills, RAG-style
memory notes, LoCoMo sessions. Per item and method: logit cosine, top-1, KL(full || method),
decision agreement (LoCoMo: same normalised answer), task score (decision correct; LoCoMo token
F1 of a greedy answer), recompute fraction (block tokens recomputed / block tokens) and TTFT
ratio (method / full prefill, wall clock from stored blocks and cached head to first-token
logits, as in compose_scaling). The summary gives CIs over items, the frontier per budget and
whether a method is within 1 % of full-prefill task score at <= 15 % recompute. A verification
(kvnotes.compose.verify.require_go) runs first; on no-go the run stops unless `force`.

    python -m experiments.run +experiment=blend model=llama device=cpu experiment.threads=1
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
import torch.utils.benchmark as benchmark

from experiments.shared import workloads as wl
from experiments.shared.kvboost import KvboostConfig, kvboost_records, resolve
from kvnotes.compose import blend
from kvnotes.compose import splice as compose
from kvnotes.compose.blend import Method
from kvnotes.compose.verify import NoGoError, require_go
from kvnotes.engine import run as engine
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import (
    ci_dict,
    cluster_bootstrap_ci,
    kl_divergence,
    logit_cosine,
    top1_agree,
    wider,
    wilson_ci,
)
from kvnotes.measure.timing import measure, torch_threads
from kvnotes.tasks import locomo

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from experiments.shared.workloads import BlendItem
    from kvnotes.models import LoadedModel

log = logging.getLogger(__name__)
WORKLOADS = ("skills", "memory", "locomo")
VERIFY = "verify"
TARGET_BUDGET, TARGET_DROP = 0.15, 0.01  # within 1 % of full-prefill task score at <= 15 %
BUDGET_TOL = 0.005  # a method is within a budget up to half a point (rounding to whole tokens)


PROMPT_AROUND = 256  # tokens of system prompt + question around a workload's blocks (bound)


@dataclass
class BlendConfig:
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    n_items: int = 12  # per workload
    # [start, stop): run only these of the n_items built per workload (a shard of a run too long
    # for one session; `python -m analysis.reference --merge` joins shards into one run)
    item_slice: list[int] | None = None
    skills_length: int = 600  # tokens per skills prompt (3 skill blocks)
    memory_blocks: int = 6
    memory_block_tokens: int = 150
    locomo_path: str = "../shared/data/locomo/locomo10.json"  # relative: to the repository root
    locomo_blocks: int = 5  # sessions per prompt
    locomo_block_tokens: int = 300  # per session, cut at a turn boundary
    max_new_tokens: int = 12  # LoCoMo greedy answer
    seams: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    budgets: list[float] = field(default_factory=lambda: [0.05, 0.10, 0.15, 0.20, 0.30])
    check_layer: int = 1  # CacheBlend's early layer
    note_seams: list[int] = field(default_factory=lambda: [0, 2])  # note-aware: first S tokens per block too
    timing_repeats: int = 1  # extra timed rounds are medianed with the first
    kvboost: KvboostConfig = field(default_factory=KvboostConfig)
    verify_probes: int = 4
    force: bool = False  # run even when kvnotes.compose.verify says no-go (recorded)
    threads: int | None = None
    n_boot: int = 1000

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise ConfigError(f"workloads {bad or '[]'}; valid: {', '.join(WORKLOADS)}")
        if self.n_items < 1 or self.skills_length < 1 or self.max_new_tokens < 1:
            raise ConfigError("n_items, skills_length and max_new_tokens must be >= 1")
        if min(self.memory_blocks, self.locomo_blocks) < 1 or min(self.memory_block_tokens, self.locomo_block_tokens) < 16:
            raise ConfigError("*_blocks >= 1 and *_block_tokens >= 16 are needed")
        if any(k < 1 for k in self.seams) or not all(0 < b <= 1 for b in self.budgets):
            raise ConfigError(f"seams >= 1 and budgets in (0, 1] are needed: {self.seams}, {self.budgets}")
        if not self.note_seams or any(s < 0 for s in self.note_seams):
            raise ConfigError(f"note_seams must be a non-empty list of ints >= 0, got {self.note_seams}")
        if self.item_slice is not None and (len(self.item_slice) != 2
                                            or not 0 <= self.item_slice[0] < self.item_slice[1] <= self.n_items):
            raise ConfigError(f"item_slice must be [start, stop) with 0 <= start < stop <= n_items "
                              f"({self.n_items}), got {self.item_slice}")
        if self.check_layer < 0 or self.timing_repeats < 1 or self.verify_probes < 1:
            raise ConfigError("check_layer >= 0, timing_repeats >= 1 and verify_probes >= 1 are needed")

    def check_inputs(self) -> None:
        """Files the run reads, checked before any heavy work (not at composition: a machine
        without the LoCoMo file can still compose and test the config)."""
        if "locomo" in self.workloads and not resolve(self.locomo_path).is_file():
            raise ConfigError(f"locomo_path {resolve(self.locomo_path)} is not a file (the official "
                              "locomo10.json); set experiment.locomo_path or drop locomo from workloads")

    def methods(self) -> list[Any]:

        return ([Method("naive")] + [Method("seam", k) for k in self.seams]
                + [Method(f, r, self.check_layer) for f in ("cacheblend", "attribution") for r in self.budgets]
                + [Method("query_aware", r) for r in self.budgets]
                + [Method("notes", r, seam=s) for s in self.note_seams for r in self.budgets])

    def suite_lengths(self) -> list[tuple[str, str, int, int]]:
        """(setting, suite, n_items, length) of the suites this job builds, for the runner to
        check the length against their prompts before the model loads."""
        return [("skills_length", "skills", self.n_items, self.skills_length)] if "skills" in self.workloads else []

    def longest_prompt(self) -> tuple[str, int, int]:
        """The longest workload's blocks with the system prompt, question and answer around them
        (bound: PROMPT_AROUND + max_new_tokens), for the position check."""
        sizes = {"skills_length": self.skills_length if "skills" in self.workloads else 0,
                 "memory_blocks x memory_block_tokens": self.memory_blocks * self.memory_block_tokens
                 if "memory" in self.workloads else 0,
                 "locomo_blocks x locomo_block_tokens": self.locomo_blocks * self.locomo_block_tokens
                 if "locomo" in self.workloads else 0}
        setting = max(sizes, key=lambda k: sizes[k])
        return setting, sizes[setting], PROMPT_AROUND + self.max_new_tokens


# --- one item ------------------------------------------------------------------------------------


def _timed(fn: Any, repeats: int, device: torch.device) -> tuple[Any, float]:
    """(result of the first call, seconds). One repeat: that call's time, device synchronised
    (kvnotes.measure.timing). More: the median per-call time of torch.utils.benchmark.Timer's
    blocked runs over about `repeats - 1` further calls' worth of time (it warms up, fixes the
    threads and synchronises CUDA itself). Timer fits here: one path's calls run back to back and
    need no setup between them (benchmarks.engine's interleaved rounds are not Timer's case)."""
    out, seconds, _ = measure(fn, device, memory=False)
    if repeats <= 1:
        return out, seconds
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return out, float(timer.blocked_autorange(min_run_time=(repeats - 1) * seconds).median)


def _answer(model: LoadedModel, cache: Any, last: int, max_new: int) -> str:
    """Greedy answer continuing a prompt whose cache holds all but its last token `last`."""

    tok = model.tokenizer
    ids, _ = compose.greedy(model, cache, [last], max_new, tuple(getattr(tok, "all_special_ids", []) or ()))
    return str(tok.decode(ids)).strip().split("\n")[0].strip()


def _score(model: LoadedModel, item: BlendItem, step: Any, max_new: int) -> dict[str, Any]:
    """Decision (argmax over the outcome tokens) or the LoCoMo answer of a prompt's last step."""
    logits = step.logits[0, -1]
    if item.gold is None:
        ids = list(item.decision_ids)
        dec = ids[int(logits[ids].argmax())]
        return {"decision": dec, "task_score": float(dec == item.correct_id)}
    n = step.cache.seq_len
    ans = _answer(model, step.cache.slice(0, n - 1), item.layout.ids[-1], max_new)

    return {"decision": locomo.normalize(ans), "answer": ans, "task_score": locomo.f1(ans, item.gold)}


def item_records(model: LoadedModel, item: BlendItem, cfg: BlendConfig) -> list[dict[str, Any]]:
    """One record per method (full prefill included) for one item."""

    lay = item.layout
    full, full_s = _timed(lambda: engine.prefill(model, lay.ids), cfg.timing_repeats, model.device)
    ref = full.logits[0, -1]
    ref_score = _score(model, item, full, cfg.max_new_tokens)
    head = engine.prefill(model, list(lay.head)).cache if lay.head else None
    blocks = [compose.prefill_block(model, list(b)) for b in lay.blocks]
    engine.extend(model, head, list(lay.tail))  # warm the kernels at the tail's shape
    common = {"kind": "blend", "workload": item.workload, "item_id": item.item_id,
              "domain": item.meta.get("domain", ""), "n_blocks": len(lay.blocks),
              "n_block_tokens": lay.n_block_tokens, "n_context": len(lay.context),
              "n_tail": len(lay.tail), "time_full_s": full_s, "task_score_full": ref_score["task_score"],
              "decision_full": str(ref_score["decision"])}
    rows = [{**common, "method": "full", "setting": 1.0, "name": "full", "recomputed": lay.n_block_tokens,
             "checked": 0, "cosine": 1.0, "top1_agree": True, "kl": 0.0, "decision_agree": True,
             "task_score": ref_score["task_score"], "time_s": full_s, "decision": str(ref_score["decision"]),
             "answer": ref_score.get("answer", "")}]
    for m in cfg.methods():
        def go(m: Any = m) -> tuple[Any, Any]:
            built = blend.build(model, lay, head, blocks, m)
            return built, engine.extend(model, built.cache, list(lay.tail))
        (built, step), dt = _timed(go, cfg.timing_repeats, model.device)
        logits = step.logits[0, -1]
        sc = _score(model, item, step, cfg.max_new_tokens)
        rows.append({**common, "method": m.curve, "setting": float(m.setting), "name": m.name,
                     "recomputed": built.recomputed, "checked": built.checked,
                     "cosine": float(logit_cosine(logits, ref)), "top1_agree": bool(top1_agree(logits, ref)),
                     "kl": float(kl_divergence(ref, logits)),
                     "decision_agree": str(sc["decision"]) == str(ref_score["decision"]),
                     "task_score": sc["task_score"], "time_s": dt, "decision": str(sc["decision"]),
                     "answer": sc.get("answer", "")})
    for r in rows:
        r["recompute_fraction"] = r["recomputed"] / lay.n_block_tokens
        r["ttft_ratio"] = r["time_s"] / full_s
    return rows


# --- summary -------------------------------------------------------------------------------------


def _prop(values: Any) -> dict[str, float | int]:
    """A proportion with its Wilson interval, in the ci_dict() layout."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if not len(x):
        return {"mean": float("nan"), "ci_lo": float("nan"), "ci_hi": float("nan"), "n": 0}
    p, lo, hi = wilson_ci(int(round(x.sum())), len(x))
    return {"mean": p, "ci_lo": lo, "ci_hi": hi, "n": len(x)}


def clusters_of(g: pd.DataFrame) -> list[str]:
    """The unit items share, per row: a LoCoMo item's conversation (`locomo/<conversation>/q..`),
    else the item's domain (a skills prompt's skill set, a memory prompt's topic)."""
    return [i.split("/")[1] if w == "locomo" else str(d)
            for i, w, d in zip(g["item_id"], g["workload"], g["domain"], strict=True)]


def _with_cluster(d: dict[str, Any], values: Any, clusters: list[str], n_boot: int) -> dict[str, Any]:
    """A summary cell with its cluster-bootstrap interval beside the item one (`ci_cluster`)."""
    return d | {"ci_cluster": cluster_bootstrap_ci(np.asarray(values, float), clusters, n_boot=n_boot)}


def method_stats(g: pd.DataFrame, n_boot: int) -> dict[str, Any]:
    binary = bool(g["task_score"].dropna().isin([0.0, 1.0]).all())
    task = _prop if binary else (lambda v: ci_dict(v, n_boot))
    cl = clusters_of(g)
    delta = np.asarray(g["task_score"], float) - np.asarray(g["task_score_full"], float)
    return {
        "method": str(g["method"].iloc[0]), "setting": float(g["setting"].iloc[0]),
        "recompute_fraction": float(g["recompute_fraction"].mean()),
        "cosine": _with_cluster(ci_dict(g["cosine"], n_boot), g["cosine"], cl, n_boot), "kl": ci_dict(g["kl"], n_boot),
        "top1_agree": _prop(g["top1_agree"].astype(float)),
        "decision_agree": _prop(g["decision_agree"].astype(float)),
        "task_score": _with_cluster(task(g["task_score"]), g["task_score"], cl, n_boot),
        "task_score_full": task(g["task_score_full"]),
        "task_delta": _with_cluster(ci_dict(delta, n_boot), delta, cl, n_boot),
        "ttft_ratio": ci_dict(g["ttft_ratio"], n_boot),
    }


def versus_cacheblend(gw: pd.DataFrame, n_boot: int) -> dict[str, Any]:
    """Per budget r and per method at r (attribution, query-aware, note-aware): the paired
    difference in task score and logit cosine, method - CacheBlend at the same r, over the items
    both ran (item bootstrap and the cluster bootstrap of clusters_of). `beats` lists the methods
    whose difference in task score has its wider interval wholly above 0; `beats_disjoint` those
    whose own task-score interval lies wholly above CacheBlend's (the issue's reading: intervals
    that do not overlap)."""
    wide = {m: g.set_index("item_id") for m, g in gw.groupby("name", sort=False)}
    out: dict[str, Any] = {}
    for cb in [n for n in wide if n.startswith("cacheblend@")]:
        budget = cb.split("@", 1)[1]
        ref = wide[cb]
        rows: dict[str, Any] = {}
        for name in [n for n in wide if n.endswith(f"@{budget}") and n != cb and not n.startswith("kvboost")]:
            both = wide[name].index.intersection(ref.index)
            a, b = wide[name].loc[both], ref.loc[both]
            cl = clusters_of(a.reset_index())
            row: dict[str, Any] = {"n": len(both)}
            for metric in ("task_score", "cosine"):
                d = np.asarray(a[metric], float) - np.asarray(b[metric], float)
                row[metric] = _with_cluster(ci_dict(d, n_boot), d, cl, n_boot)
            sa, sb = (ci_dict(x["task_score"], n_boot) for x in (a, b))
            row["disjoint"] = bool(sa["ci_lo"] > sb["ci_hi"])
            rows[name] = row
        beats = [n for n, r in rows.items() if wider(r["task_score"], r["task_score"]["ci_cluster"])["ci_lo"] > 0]
        out[budget] = {"cacheblend": cb, "methods": rows, "beats": beats,
                       "beats_disjoint": [n for n, r in rows.items() if r["disjoint"]]}
    return out


def frontier(methods: dict[str, dict[str, Any]], budgets: list[float]) -> dict[str, Any]:
    """Per budget: the method (full prefill excluded) with the best mean cosine and task score
    among those whose mean recompute fraction is within the budget (+ BUDGET_TOL; ties: the
    cheaper one)."""
    def best(ok: dict[str, dict[str, Any]], metric: str) -> dict[str, Any] | None:
        if not ok:
            return None
        name = max(ok, key=lambda n: (ok[n][metric]["mean"], -ok[n]["recompute_fraction"]))
        return {"name": name, "value": ok[name][metric]["mean"],
                "recompute_fraction": ok[name]["recompute_fraction"]}

    out: dict[str, Any] = {}
    for b in sorted(budgets):
        ok = {n: s for n, s in methods.items() if s["method"] != "full" and s["recompute_fraction"] <= b + BUDGET_TOL}
        out[f"{b:g}"] = {metric: best(ok, metric) for metric in ("cosine", "task_score")}
    return out


def summarize(records: list[dict[str, Any]], cfg: BlendConfig) -> dict[str, Any]:
    df = pd.DataFrame(records)
    out: dict[str, Any] = {}
    kind = df["kind"] if "kind" in df.columns else pd.Series([], dtype=str)
    ver = df[kind == VERIFY]
    if len(ver):
        out["verify"] = {k: ver.iloc[0][k] for k in ("go", "reasons", "roundtrip_rel", "offset_rel", "verify_forced")}
    b = df[kind == "blend"]
    out["workloads"] = {}
    for w, gw in b.groupby("workload", sort=False):
        methods = {str(n): method_stats(g, cfg.n_boot) for n, g in gw.groupby("name", sort=False)}
        full = methods.get("full", {}).get("task_score", {}).get("mean", float("nan"))
        target = [n for n, s in methods.items() if s["method"] != "full"
                  and s["recompute_fraction"] <= TARGET_BUDGET + BUDGET_TOL
                  and s["task_score"]["mean"] >= full - TARGET_DROP * abs(full)]
        out["workloads"][str(w)] = {
            "n_items": int(gw["item_id"].nunique()), "n_blocks_mean": float(gw["n_blocks"].mean()),
            "n_block_tokens_mean": float(gw["n_block_tokens"].mean()), "methods": methods,
            "frontier": frontier(methods, [*cfg.budgets, 1.0]),
            "within_1pct_at_15pct": target,
            "versus_cacheblend": versus_cacheblend(gw, cfg.n_boot),
        }
    return out


# --- the run ---------------------------------------------------------------------------------------


def verify_record(rep: Any, forced: bool) -> dict[str, Any]:
    cos = {f"cosine_k{s['seam']}": s["cosine"] for s in rep.splice}
    return {"kind": VERIFY, "go": rep.go, "reasons": "; ".join(rep.reasons), "verify_forced": forced,
            "roundtrip_rel": rep.rope.get("roundtrip_rel", np.nan),
            "offset_rel": rep.rope.get("offset_rel", np.nan), **cos}


def build_items(ctx: Context, cfg: BlendConfig, workload: str) -> list[BlendItem]:

    tok, chat, seed = ctx.model.tokenizer, ctx.chat, ctx.cfg.seed
    if workload == "skills":
        return wl.skills_items(tok, chat, cfg.n_items, cfg.skills_length, seed)
    if workload == "memory":
        return wl.memory_items(tok, chat, cfg.n_items, cfg.memory_blocks, cfg.memory_block_tokens, seed)
    items = wl.locomo_items(str(resolve(cfg.locomo_path)), tok, chat, cfg.n_items, cfg.locomo_blocks,
                            cfg.locomo_block_tokens, seed)
    if not items:
        raise ValueError(f"no LoCoMo item: no conversation with >= {cfg.locomo_blocks} sessions and an "
                         f"answerable question inside them in {resolve(cfg.locomo_path)}")
    return items


def run(ctx: Context) -> None:

    cfg: BlendConfig = ctx.params
    cfg.check_inputs()
    with torch_threads(cfg.threads):
        try:
            rep = require_go(ctx.model, force=cfg.force, n_probes=cfg.verify_probes)
        except NoGoError:
            rep = require_go(ctx.model, force=True)
            if not ctx.done(VERIFY):
                ctx.write(VERIFY, [verify_record(rep, False)])
            raise
        for key in ctx.pending([VERIFY], desc="verify"):
            ctx.write(key, [verify_record(rep, cfg.force and not rep.go)])
        for w in cfg.workloads:
            items = build_items(ctx, cfg, w)
            if cfg.item_slice is not None:  # the items are built in full first: a shard's are the run's
                items = items[cfg.item_slice[0]:cfg.item_slice[1]]
            units = {f"{w}:{it.item_id}": it for it in items}
            for key in ctx.pending(list(units), desc=f"blend {w}"):
                ctx.write(key, item_records(ctx.model, units[key], cfg))
            if cfg.kvboost.enabled:
                for key in ctx.pending([f"kvboost:{w}"], desc=f"kvboost {w}"):
                    ctx.write(key, kvboost_records(ctx.model, items, cfg.kvboost, cfg.max_new_tokens))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "blend"
CONFIG = BlendConfig
HELP = "cache reuse head to head: naive, seam/LegoLink, CacheBlend, attribution, query-aware, note-aware, kvboost"
