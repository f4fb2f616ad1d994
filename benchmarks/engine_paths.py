"""The engine benchmark's workloads (benchmarks/engine.py times them): the FLOP estimate, the
edit paths, the composed paths of one block and of eight (full, transplant warm / cold / without
hash / at extra seams, limit), and kvboost's modes on the eight-block prompt."""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from experiments.shared import kvboost
from experiments.shared.skill_prompts import question_ids, skill_ids
from kvnotes import tasks
from kvnotes.compose import splice as compose
from kvnotes.compose.inplace import transplant_extend_inplace
from kvnotes.compose.store import block_path, load_block, save_block
from kvnotes.compose.tiers import MemoryTier
from kvnotes.edit.attribution import attribute_cache
from kvnotes.edit.patching import make_pair, patched_scores
from kvnotes.edit.strategies import Editor
from kvnotes.engine import run
from kvnotes.engine.cache import buffers
from kvnotes.engine.graphs import GraphedExtend
from kvnotes.engine.limit import bare_cache, bare_forward
from kvnotes.measure.metrics import logit_cosine
from kvnotes.tasks.skills import skill_names

SEAM = 4
N_BLOCKS = 8
# where the one-block workload's in-place transplant reads its block from (kvnotes.compose.tiers):
# device memory, host memory (one transfer per block; on CPU no transfer: the device is the host),
# local disk with a cold and a warm page cache (verified on every read: a read is an entry)
TIERS = ("device", "host", "disk", "disk_warm")


# --- FLOPs ----------------------------------------------------------------------------------


def forward_flops(model: Any, q: int, past: int, logits: int = 1) -> float:
    """Multiply-adds x 2 of q tokens after `past` cached ones: linear layers, attention, LM head."""
    layers = model.adapter.layers(model.hf)
    linear = sum(p.numel() for n, p in layers.named_parameters() if p.ndim == 2)
    heads, d = model.adapter.n_heads(model.hf), model.adapter.head_dim(model.hf)
    attended = q * past + q * (q + 1) / 2  # keys read by the q new tokens, causally
    attn = len(layers) * 4 * heads * d * attended  # q.k and w.v
    head = 2 * logits * model.config.hidden_size * model.config.vocab_size
    return float(2 * q * linear + attn + head)


def gemm_pass(model: Any, q: int) -> Callable[[], None]:
    """Every linear layer of the decoder applied once to q rows (and the LM head to one row), with
    nothing around them: the matrix products a forward of q tokens cannot avoid, at the batch
    shape it runs them in. Timed beside a path, it measures that path's GEMM floor on this machine
    (small batches run below a prefill's FLOP rate on CPUs, which a token or FLOP share ignores)."""
    layers = model.adapter.layers(model.hf)
    linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.hf.get_output_embeddings()
    xs = {m.in_features: torch.randn(1, q, m.in_features, dtype=model.dtype, device=model.device)
          for m in linears}
    last = torch.randn(1, 1, model.config.hidden_size, dtype=model.dtype, device=model.device)

    @torch.inference_mode()
    def run() -> None:
        for m in linears:
            m(xs[m.in_features])
        if head is not None:
            head(last)

    return run


# --- the limit, outside kvnotes' call path: kvnotes.engine.limit (bare_cache, bare_forward) ----------


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to forget a file's cached pages (clean pages: no root needed)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


# --- workloads --------------------------------------------------------------------------------


@dataclass
class Timed:
    """One timed path: `setup` runs untimed before each call of `fn`."""

    name: str
    fn: Callable[[], Any]
    setup: Callable[[], None] | None = None
    times: list[float] = field(default_factory=list)
    last: Any = None
    peak_bytes: int = 0  # on CUDA: the most memory allocated during one timed call


def edit_paths(model: Any, length: int, with_map: bool,
               with_attribution: bool = False) -> tuple[list[Timed], dict[str, Any]]:
    item = tasks.build_suite("gated", model.tokenizer, chat=model.chat, n_items=1, length=length, seed=0)[0]
    ed = Editor(model, item)
    err = ed.erratum()
    kept = len(err.ids) - err.recomputed  # stale tokens the erratum keeps cached
    flop_floor = forward_flops(model, err.recomputed, kept) / forward_flops(model, item.n_tokens, 0)
    info = {"edit_tokens": item.n_tokens, "erratum_floor": err.recompute_fraction,
            "erratum_flop_floor": flop_floor, "erratum_kept_tokens": kept,
            "erratum_tokens": err.recomputed, "full_downstream_tokens": item.n_tokens - item.field_span[0]}
    tail = ed.tail.to(model.device)
    bare: dict[str, Any] = {}
    held = buffers(ed.stale, tail.shape[1], 1, model.device)
    at, rest = ed.erratum_ids()  # the erratum over buffers holding the stale cache: no copy
    held_err = buffers(ed.stale, max(0, at + len(rest) - ed.stale.seq_len), 1, model.device)
    info["erratum_inplace_max_abs_diff"] = float(
        (run.extend_into(model, *held_err, at, rest).logits[0, -1] - err.logits).abs().max())
    paths = [
        Timed("prefill", lambda: run.prefill(model, item.new_ids)),
        Timed("extend1", lambda: run.extend(model, ed.stale, ed.tail)),
        # the same token into buffers that already hold the cache with room: a decode step
        Timed("extend1_inplace", lambda: run.extend_into(model, *held, ed.stale.seq_len, ed.tail)),
        # the same token through transformers alone over a DynamicCache (built untimed each call)
        Timed("extend1_bare", lambda: bare_forward(model, bare["cache"], tail),
              lambda: bare.update(cache=bare_cache(ed.stale))),
        Timed("extend1_gemms", gemm_pass(model, 1)),
        # the one copy of the cache a forward makes (into buffers with room for the new token)
        Timed("extend1_copy", lambda: buffers(ed.stale, 1, 1, model.device)),
        Timed("full_downstream", lambda: ed.full_downstream()),
        Timed("erratum", lambda: ed.erratum()),
        # the same erratum written into buffers that hold the stale cache (a server owning its
        # cache): its K/V overwrite the stale slots from `at` on, nothing is copied
        Timed("erratum_inplace", lambda: run.extend_into(model, *held_err, at, rest)),
        Timed("erratum_gemms", gemm_pass(model, err.recomputed)),
    ]
    if model.device.type == "cuda":  # the same short forwards replayed from CUDA graphs (engine.graphs)
        paths += graph_paths(model, ed.stale, tail, at, rest)
    if with_map or with_attribution:  # the exact per-position map; attribution's beside it
        pair = make_pair(model, item)
        paths.append(Timed("map", lambda: patched_scores(model, pair, [[q] for q in pair.field_to_end])))
        info["map_positions"] = len(pair.field_to_end)
    if with_attribution:  # one forward + backward, every position x layer x KV head (kvnotes.edit.attribution)
        paths.append(Timed("attribution", lambda: attribute_cache(model, pair)))
    return paths, info


def graph_paths(model: Any, stale: Any, tail: torch.Tensor, at: int, rest: list[int]) -> list[Timed]:
    """extend1 and the erratum, each captured once in a CUDA graph over its own held buffers."""

    one = GraphedExtend(model, *buffers(stale, tail.shape[1], 1, model.device), stale.seq_len, tail.shape[1])
    room = max(0, at + len(rest) - stale.seq_len)
    err = GraphedExtend(model, *buffers(stale, room, 1, model.device), at, len(rest))
    ids = torch.tensor([rest], device=model.device)
    return [Timed("extend1_graph", lambda: one(tail)), Timed("erratum_graph", lambda: err(ids))]


def _composed(model: Any, store: Path, prefix: list[int], blocks: list[list[int]], question: list[int],
              tag: str, extra_seams: tuple[int, ...] = (), tiers: bool = False) -> tuple[list[Timed], dict[str, Any]]:
    """full / transplant (warm, cold; seam SEAM, and each of `extra_seams`) / in place (device
    tier; at K = 0 too when 0 is among `extra_seams`; `tiers`: also from the host tier and from
    disk, cold and warm) / limit paths of prefix + blocks + question."""

    files = []
    for j, ids in enumerate(blocks):
        path = block_path(store, f"{tag}-{j}")
        save_block(path, model, compose.prefill_block(model, ids), name=f"{tag}-{j}")
        files.append(path)
    prefix_cache = run.prefill(model, prefix).cache  # the cached system prompt, on both sides
    body = [t for ids in blocks for t in ids]
    full_step = run.extend(model, prefix_cache, body + question)
    context = full_step.cache.slice(0, len(prefix) + len(body))  # the limit's cached context
    q = torch.tensor([question], device=model.device)
    state: dict[str, Any] = {}

    def full() -> torch.Tensor:
        return run.extend(model, prefix_cache, body + question).logits[0, -1]

    def transplant(verify: bool = True, seam: int = SEAM) -> torch.Tensor:
        """Read from disk (content hash checked), rotate, seams + question in one forward."""
        loaded = [load_block(f, model, device=model.device, verify=verify) for f in files]
        return compose.transplant_extend(model, prefix_cache, loaded, seam, question).logits[0, -1]

    # the blocks already in the model device's memory, as a server's hot tier holds them
    resident = [compose.Block(b.ids, b.cache.clone())
                for b in (load_block(f, model, device=model.device) for f in files)]

    def cold_setup() -> None:
        for f in files:
            drop_page_cache(f)

    def limit_setup() -> None:
        state["bare"] = bare_cache(context)

    device_tier, host_tier = MemoryTier(model, "device"), MemoryTier(model, "host")
    names = [device_tier.admit(f) for f in files]  # verified once, here, as they enter
    for f in files:
        host_tier.admit(f)

    def inplace(tier: Any = device_tier, seam: int = SEAM) -> torch.Tensor:
        """The blocks attended where they lie (no rotation, no copy): compose.inplace."""
        blks = [tier.get(n) for n in names] if tier is not None else \
            [load_block(f, model, device=model.device) for f in files]
        logits = transplant_extend_inplace(model, prefix_cache, blks, seam, question).logits
        assert logits is not None
        return logits[0, -1]

    held = buffers(context, len(question), 1, model.device)  # the context in place, with room

    paths = [
        Timed(f"{tag}_full", full),
        Timed(f"{tag}_transplant", transplant),
        Timed(f"{tag}_transplant_cold", transplant, cold_setup),
        Timed(f"{tag}_transplant_unverified", lambda: transplant(verify=False)),
        Timed(f"{tag}_transplant_resident", lambda: compose.transplant_extend(
            model, prefix_cache, resident, SEAM, question).logits[0, -1]),
        Timed(f"{tag}_limit", lambda: bare_forward(model, state["bare"], q), limit_setup),
        Timed(f"{tag}_limit_engine", lambda: run.extend(model, context, question).logits[0, -1]),
        Timed(f"{tag}_limit_inplace",
              lambda: run.extend_into(model, *held, context.seq_len, question).logits[0, -1]),
    ]
    for k in extra_seams:
        paths.append(Timed(f"{tag}_transplant_k{k}", functools.partial(transplant, seam=k)))
    paths.append(Timed(f"{tag}_inplace", inplace))  # the device tier
    if 0 in extra_seams:
        paths.append(Timed(f"{tag}_inplace_k0", functools.partial(inplace, seam=0)))
    if tiers:
        paths += [Timed(f"{tag}_tier_host", functools.partial(inplace, host_tier)),
                  Timed(f"{tag}_tier_disk", functools.partial(inplace, None), cold_setup),
                  Timed(f"{tag}_tier_disk_warm", functools.partial(inplace, None))]
    ref = full_step.logits[0, -1]
    seam_tokens = sum(min(SEAM, len(b)) for b in blocks)
    flops_full = forward_flops(model, len(body) + len(question), len(prefix))
    flops_limit = forward_flops(model, len(question), len(prefix) + len(body))
    flops_transplant = forward_flops(model, seam_tokens + len(question), len(prefix) + len(body) - seam_tokens)
    info = {f"{tag}_tokens": len(prefix) + len(body) + len(question), f"{tag}_question_tokens": len(question),
            f"{tag}_seam_tokens": seam_tokens, f"{tag}_limit_flop_speedup": flops_full / flops_limit,
            f"{tag}_flop_ceiling": flops_limit / flops_transplant,
            f"{tag}_cosine": float(logit_cosine(transplant(), ref)),
            f"{tag}_limit_max_abs_diff": float((bare_forward(model, bare_cache(context), q) - ref).abs().max()),
            f"{tag}_limit_inplace_max_abs_diff": float(
                (run.extend_into(model, *held, context.seq_len, question).logits[0, -1] - ref).abs().max())}
    for k in extra_seams:
        info[f"{tag}_cosine_k{k}"] = float(logit_cosine(transplant(seam=k), ref))
    info[f"{tag}_inplace_max_abs_diff"] = float((inplace() - transplant()).abs().max())
    info[f"{tag}_inplace_cosine"] = float(logit_cosine(inplace(), ref))
    info[f"{tag}_host_pinned"] = host_tier.pinned
    return paths, info


def ttft_paths(model: Any, length: int, store: Path) -> tuple[list[Timed], dict[str, Any]]:
    prefix, question = question_ids(model.tokenizer, "refund", model.chat)
    block = skill_ids(model.tokenizer, "refund", length, seed=0)
    return _composed(model, store, prefix, [block], question, "one", tiers=True)


MULTI_EXTRA_SEAMS = (0, 1)  # the eight-block splice also without repair and with one token per seam


def multiblock_prompt(model: Any, length: int) -> tuple[list[int], list[list[int]], list[int]]:
    """(system prefix, eight skill blocks of length/8 tokens, question) of the eight-block workload."""

    names = skill_names()
    prefix, question = question_ids(model.tokenizer, "refund", model.chat)
    size = max(SEAM + 1, length // N_BLOCKS)
    blocks = [skill_ids(model.tokenizer, names[j % len(names)], size, seed=j) for j in range(N_BLOCKS)]
    return prefix, blocks, question


def multiblock_paths(model: Any, length: int, store: Path) -> tuple[list[Timed], dict[str, Any]]:
    prefix, blocks, question = multiblock_prompt(model, length)
    return _composed(model, store, prefix, blocks, question, "multi", MULTI_EXTRA_SEAMS)


# kvboost's strategies as today's worker drives them: each 64-token chunk warmed in its own call, so
# every chunk but the first is a content-hash match and kvboost forces CacheBlend in every mode
KVBOOST_MODES: dict[str, dict[str, Any]] = {"none": {"strategy": "none"}, "selective": {"strategy": "selective", "overlap": 16},
                 "cacheblend": {"strategy": "cacheblend", "ratio": 0.15}}
# The same strategies driven as kvboost documents it (key prefix): "doc_", its long-context
# configuration (README: chunk 128, boundary window 16, overlap_k 16, sink tokens 32, recency 8,
# 1.5 GB; one warm() of the shared text); "blk_", its fastest exact path on this prompt: one warm()
# and one chunk per block (chunk_size None: the block length), no continuity knobs.
KVBOOST_SETUPS: dict[str, dict[str, Any]] = {
    "doc_": {"chunk_size": 128, "warm": "context",
             "engine": {"chunk_boundary_window": 16, "overlap_k": 16, "sink_tokens": 32,
                        "recency_window_chunks": 8, "max_cache_bytes": 1_500_000_000}},
    "blk_": {"chunk_size": None, "warm": "context", "engine": {}},
}


def kvboost_configs(block_len: int) -> dict[str, dict[str, Any]]:
    """Every (setup, strategy) the benchmark runs, keyed "<setup><mode>" ("" is today's driving)."""
    out = {m: {**c, "warm": "chunks", "chunk_size": 64} for m, c in KVBOOST_MODES.items()}
    for tag, setup in KVBOOST_SETUPS.items():
        out |= {tag + m: {**c, **setup, "chunk_size": setup["chunk_size"] or block_len} for m, c in KVBOOST_MODES.items()}
    return out


def kvboost_multiblock(model: Any, length: int, python: str, reps: int) -> dict[str, Any]:
    """kvboost on the eight-block prompt (its own venv), per setup and strategy (kvboost_configs):
    over `reps` items after one warm-up item, the median of its own full prefill's wall-clock TTFT
    over the config's (`_speedup`), the same ratio on kvboost's own ttft_ms, which starts after
    assembly and repair (`_reported_speedup`), the median first-token logit cosine to that
    prefill, the reuse ratio, and whether an approximate match forced CacheBlend (`_cacheblend_forced`)."""

    prefix, blocks, question = multiblock_prompt(model, length)
    context = prefix + [t for b in blocks for t in b]
    tok = model.tokenizer
    items = [{"key": f"r{r}", "text": tok.decode(context + question), "context_text": tok.decode(context),
              "max_new_tokens": 1} for r in range(reps + 1)]
    confs = kvboost_configs(len(blocks[0]))
    res, logits = kvboost.run_worker(python, model, confs, items, 64, 3600)
    res = [r for r in res if r["key"] != "r0"]  # the first item warms its process up, as ours do
    base = {r["key"]: r for r in res if r["config"] == "baseline"}
    row: dict[str, Any] = {"kvboost_full_s": statistics.median(r["ttft_s"] for r in base.values())}
    base_reported = statistics.median(float(r["reported_ttft_ms"]) for r in base.values())
    for mode in confs:
        runs = [r for r in res if r["config"] == mode]
        row[f"kvboost_{mode}_speedup"] = row["kvboost_full_s"] / statistics.median(r["ttft_s"] for r in runs)
        row[f"kvboost_{mode}_reported_speedup"] = base_reported / statistics.median(
            float(r["reported_ttft_ms"]) for r in runs)
        row[f"kvboost_{mode}_cosine"] = statistics.median(
            float(logit_cosine(logits[(r["key"], mode)], logits[(r["key"], "baseline")])) for r in runs)
        row[f"kvboost_{mode}_reuse"] = statistics.median(float(r["kv_reuse_ratio"]) for r in runs)
        row[f"kvboost_{mode}_cacheblend_forced"] = any(int(r.get("approximate_hits", 0)) > 0 for r in runs)
        row[f"kvboost_{mode}_chunk_size"] = confs[mode]["chunk_size"]
    return row
