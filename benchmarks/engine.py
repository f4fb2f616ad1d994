"""Engine benchmark: every cached path beside its reference, as ratios, in one process.

Per prompt length L, three workloads are built once and their paths timed in interleaved order
(the order rotates every repeat), after warm-up rounds, with the device synchronised around each
timed region (kvnotes.measure.timing). Medians over repeats; ratios are ratios of medians.

* edit (a gated task item of L tokens): a clean prefill of the new prompt (`prefill_s`, the
  denominator), one token against the stale cache (`extend1_ratio`) beside the same token
  through transformers alone over a `DynamicCache` (`extend1_bare_ratio`) and beside its GEMM
  floor (`extend1_gemm_floor`: every decoder linear and the LM head on one row, i.e. every weight
  streamed from memory once; `extend1_over_gemm_floor` = extend1 / that floor) and beside the one
  copy of the cache every forward makes into buffers with room for its new tokens
  (`extend1_copy_ratio`: kvnotes.engine.cache.buffers alone) and beside the same token into buffers
  that already hold the cache (`extend1_inplace_ratio`: run.extend_into, a decode step with no
  copy), `full_downstream`, the erratum edit (`erratum_ratio`; `erratum_inplace_ratio`: the same
  forward into buffers that hold the stale cache, as a server owning its cache would run it, with
  no copy) beside its token floor (`erratum_floor` = (erratum + question tokens) / prompt tokens)
  and its GEMM floor (`erratum_gemm_floor`: the decoder's linear layers
  alone, applied to as many rows as the erratum recomputes, with nothing around them: what this
  machine's matrix products cost at that batch shape; `erratum_over_gemm_floor` is the rest of
  the engine's share), with --map the per-position patching map (`map_ratio`), with --attribution that
  map beside kvnotes.edit.attribution (`attribution_ratio`: every position x layer x head from one backward);
* one block (system prefix, a skill block of L tokens, a question): TTFT of the full path
  (block + question against the cached system prefix: the prefix is cached on both sides),
  of the transplant (the block read from disk inside the timed region, rotated, seam K = 4
  repaired and the question run in one forward: compose.transplant_extend), of the same transplant with the block file dropped from the page cache
  (`transplant_cold_speedup`), without the block's content hash (`..._unverified_share_of_limit`:
  load_block(verify=False)), with the block already in the device's memory, as a server's hot
  tier holds it (`..._resident_share_of_limit`: no load), and of the limit;
* eight blocks of L/8 tokens, K = 4: the same, with all seams repaired in one forward; also at
  K = 0 (no repair) and K = 1 (`multiblock_k0_...`, `multiblock_k1_...`, each with its logit
  cosine to the full prefill), and the FLOP ceiling of the K = 4 share (`multiblock_flop_ceiling`:
  limit FLOPs / transplant FLOPs; the 8 x 4 seam tokens are work the limit does not do, so no
  K = 4 transplant can reach a share above it). The one-block path has its ceiling too.
  `--kvboost PYTHON` runs kvboost 0.9.0 as it ships (its own venv, experiments/shared/kvboost_worker.py)
  on the same eight-block prompt, `--reps` times per mode: its `none`, `selective` and `cacheblend`
  strategies, each TTFT (wall clock from the call to the first token) against kvboost's own full
  prefill, and each first-token logit cosine to that prefill (`kvboost_<mode>_speedup`, `_cosine`),
  in three setups: today's per-chunk warm of 64-token chunks (no prefix; every chunk after the
  first is then an approximate match and kvboost runs CacheBlend, a full prefill inside, in every
  mode: `_cacheblend_forced`), kvboost's documented long-context configuration (`doc_<mode>`:
  chunk 128, one warm of the context, boundary window 16, overlap_k 16, sink 32) and its fastest
  exact path here (`blk_<mode>`: one warm, one chunk per block). Compare kvnotes with `blk_none`
  (eight blocks at K = 0) and `blk_selective` (K = 4), where both sides run as fast as they can.
* in place (kvnotes.compose.inplace: the stored blocks attended where they lie, queries rotated
  instead of keys, no copy): the one block from the device tier (`inplace_share_of_limit`), the
  eight blocks at K = 4 (`multiblock_inplace_share_of_limit`) and at K = 0
  (`multiblock_k0_share_of_limit`; today's transplant at K = 0 moves to
  `multiblock_k0_transplant_share_of_limit`). Tiers (kvnotes.compose.tiers), the one block in place
  from each, as speedups over the full path: `tier_device_speedup` (held in device memory,
  verified when it entered), `tier_host_speedup` (held in host memory, pinned on CUDA, one
  transfer per block; on CPU the device is the host, so nothing moves: `one_host_pinned` False),
  `tier_disk_speedup` (read from disk with its page cache dropped by posix_fadvise(DONTNEED),
  verified on read) and `tier_disk_warm_speedup` (the same, pages cached).
* on CUDA, the 1-token extend and the erratum replayed from a CUDA graph captured once over held
  buffers (kvnotes.engine.graphs: `extend1_graph_ratio`, `erratum_graph_ratio`).

The limit is the question forwarded against an already cached context, timed three ways in the
same rounds: a bare transformers forward over a `DynamicCache` filled through its own `update`
(`limit_bare_speedup`: nothing of kvnotes on the path), kvnotes' own extend
(`transplant_limit_engine_speedup`) and kvnotes' extend_into over buffers that already hold the
context (`transplant_limit_inplace_speedup`: no copy of the cache). The limit is the fastest
(`limit_speedup`, its path in `limit_path`; kvnotes.engine.limit says why), and every share of the
limit is against it. It is checked against a FLOP estimate (`limit_flop_speedup`: full FLOPs /
limit FLOPs, an upper bound no forward can beat).

    python -m benchmarks.engine --model llama --lengths 1000,2000,4000,8000 --reps 5 --json out.json

`--profile DIR` runs the erratum and full_downstream paths once more per length under
torch.profiler (untimed) and writes their operator tables to DIR; the top entries go in the JSON.

On CPU the command makes glibc keep freed memory for reuse (`--malloc keep`, the default;
recorded as `malloc` in the JSON), so no path pays page faults on a fresh cache that a serving
process with a warm allocator would not: kvnotes.measure.timing.keep_freed_memory says what that cost.

On CUDA what each timed call allocates beyond what was held before it goes in `rise_gib`;
`peak_gib` is the weights plus the largest rise, beside `estimate_gib` (kvnotes.measure.timing.
estimate_peak_bytes: weights, four caches and a prefill's working set). The benchmark itself
holds every workload of a length at once, so its process peak is higher than any one job's.
`--random-init` times the shape of a model these machines cannot fetch (benchmarks.shapes) with
random weights; `--memory-cap-gib` runs as on a smaller GPU. scripts/gpu_checks.sh runs both on
Llama-3.1-8B's shape.

Machines are noisy: read the ratios, not the seconds. On a CPU shared with other jobs, OpenMP's
spinning waits stall small parallel regions for tens of ms; this command sets
OMP_WAIT_POLICY=PASSIVE unless the environment sets it (recorded in the JSON).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before torch starts OpenMP
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvnotes.measure.provenance import cpu_model, git_state  # noqa: E402
from kvnotes.measure.timing import (  # noqa: E402
    MemoryBudgetError,
    check_fits,
    estimate_peak_bytes,
    keep_freed_memory,
    model_bytes,
    set_memory_cap,
    timed,
)
from kvnotes.models import budget, load_model, tiny  # noqa: E402
from kvnotes.models.devices import DTYPES, resolve_device, resolve_dtype  # noqa: E402
from kvnotes.models.loading import looks_like_checkpoint  # noqa: E402
from kvnotes.models.registry import UnknownModelError, get_spec  # noqa: E402

WORKLOADS = ("edit", "ttft", "multiblock")
KEYS = ("length", "prefill_s", "extend1_ratio", "full_downstream_ratio", "erratum_ratio",
        "erratum_floor", "transplant_speedup", "limit_speedup", "transplant_share_of_limit",
        "multiblock_speedup", "multiblock_share_of_limit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--lengths", default="1000,2000,4000,8000", help="comma-separated prompt lengths")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every path per length")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--map", action="store_true", help="also time the per-position patching map")
    p.add_argument("--attribution", action="store_true", help="also time attribution patching beside the exact map")
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (device-synchronised), or the process' CPU time: on a CPU shared "
                        "with other jobs the steadier measure of the work done")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory for reuse, as a serving process does "
                        "(kvnotes.measure.timing.keep_freed_memory); default: glibc's own policy, under "
                        "which fresh caches pay page faults that vary with the heap's history")
    p.add_argument("--random-init", action="store_true",
                   help="--model is a folder with a config.json and a tokenizer (benchmarks.shapes): "
                        "build it with random weights on the device, for timing and memory only "
                        "(its cosines and greedy tokens are noise; the JSON says weights=random)")
    p.add_argument("--memory-cap-gib", type=float, default=None, metavar="GIB",
                   help="on CUDA, run as on a GPU of GIB GiB (kvnotes.measure.timing.set_memory_cap): the "
                        "memory check and the batch sizes count against the cap, and the allocator "
                        "refuses more")
    p.add_argument("--json", default=None, help="write one object per length to this file")
    p.add_argument("--kvboost", default=None, metavar="PYTHON",
                   help="the python of a venv with kvboost 0.9.0: run its modes on the eight-block prompt")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, run erratum and full_downstream once more under torch.profiler "
                        "and write their operator tables (top entries by self time) to DIR")
    a = p.parse_args(argv)
    try:
        a.lengths = [int(x) for x in str(a.lengths).split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {a.lengths!r}")
    a.only = [w.strip() for w in str(a.only).split(",") if w.strip()]
    bad = [w for w in a.only if w not in WORKLOADS]
    if bad:
        p.error(f"--only: unknown workloads {bad}; valid: {', '.join(WORKLOADS)}")
    if not a.lengths or min(a.lengths) < 64:
        p.error("--lengths must be integers >= 64")
    if a.reps < 1 or a.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return a


from benchmarks.engine_paths import (  # noqa: E402
    Timed,
    edit_paths,
    kvboost_multiblock,
    multiblock_paths,
    ttft_paths,
)
from benchmarks.engine_summary import summarize, table  # noqa: E402,F401  (tests read them here)

# --- profile ---------------------------------------------------------------------------------

PROFILED = ("erratum", "full_downstream", "one_transplant", "one_transplant_resident", "one_limit_inplace",
            "one_inplace", "multi_inplace_k0", "multi_limit_inplace")


def profile_paths(paths: list[Timed], length: int, out: Path, top: int = 15) -> dict[str, list[dict[str, Any]]]:
    """One untimed call of each PROFILED path under torch.profiler: its operator table, sorted by
    self time, goes to OUT/L<length>_<path>.txt; the top entries come back for the JSON."""

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    out.mkdir(parents=True, exist_ok=True)
    tops: dict[str, list[dict[str, Any]]] = {}
    for p in paths:
        if p.name not in PROFILED:
            continue
        with profile(activities=activities) as prof:
            p.fn()
        averages = prof.key_averages()
        (out / f"L{length}_{p.name}.txt").write_text(averages.table(sort_by=key, row_limit=40))
        total = sum(e.self_cpu_time_total for e in averages) or 1.0
        rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        tops[p.name] = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                         "self_cpu_share": e.self_cpu_time_total / total} for e in rows]
    return tops


# --- timing -----------------------------------------------------------------------------------


def run_rounds(paths: list[Timed], reps: int, warmup: int, device: torch.device, clock: str = "wall") -> None:
    """Warm-up rounds, then `reps` timed rounds, each path once per round in a rotated order.
    Not torch.utils.benchmark.Timer: it times one statement back to back (its own warm-ups), with
    no untimed setup per call, no rotation between paths and no CPU-time clock (#34)."""

    cuda = device.type == "cuda"
    for r in range(warmup + reps):
        k = r % len(paths)
        for p in paths[k:] + paths[:k]:
            if p.setup is not None:
                p.setup()
            if cuda:  # per path; on CPU a peak reading needs a heap trim that would skew the time
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)
            with timed(device) as t:
                p.last = p.fn()
            if cuda:  # what the call allocated beyond what was held before it
                p.peak_bytes = max(p.peak_bytes, torch.cuda.max_memory_allocated(device) - held)
            if r >= warmup:
                p.times.append(t.seconds if clock == "wall" else t.cpu_seconds)


PROMPT_AROUND = 128  # tokens around a benchmark prompt of L tokens: system prefix and question, or an erratum


def preflight(a: argparse.Namespace) -> str | None:
    """Why these arguments cannot run, found before any weights load (None: they can): an unknown
    model or dtype, or a length that with the tokens around it exceeds the model's positions."""

    if a.dtype not in ("auto", *DTYPES):
        return f"--dtype {a.dtype!r}: valid: auto, {', '.join(DTYPES)}"
    if a.memory_cap_gib is not None and not (a.device.startswith("cuda") or (
            a.device == "auto" and torch.cuda.is_available())):
        return f"--memory-cap-gib needs a CUDA device (--device {a.device})"
    if a.random_init:
        if not (Path(a.model).expanduser() / "config.json").is_file():
            return (f"--random-init: {a.model!r} is not a folder with a config.json "
                    f"(write one: python -m benchmarks.shapes llama-3.1-8b DIR)")
        return None
    try:
        get_spec(a.model)
    except UnknownModelError as e:
        if not looks_like_checkpoint(a.model):
            return f"--model: {e.args[0]}; or give an HF checkpoint folder or hub id"
        return None  # a checkpoint's positions are checked when it loads
    shape = budget.model_shape(a.model, None, None)
    if shape is None:  # not on this machine yet: loading fetches it, then fails clearly if too short
        return None
    return budget.position_problem(max(a.lengths), a.model, shape, "--lengths", PROMPT_AROUND)


def load(a: argparse.Namespace) -> Any:
    """The model, after the memory check (kvnotes.measure.timing.check_fits, printed). With
    --random-init the check runs on the config's sizes before any weights exist; a packaged or
    checkpoint model is checked once its weights are resident. MemoryBudgetError: does not fit."""

    dev = resolve_device(a.device)
    if a.memory_cap_gib is not None:
        set_memory_cap(dev, a.memory_cap_gib)
    tokens = max(a.lengths)
    if a.random_init:
        dtype = str(resolve_dtype(a.dtype, None, dev)).removeprefix("torch.")
        print(check_fits(tiny.random_model(a.model, device="meta", dtype=dtype), tokens, caches=4, device=dev),
              flush=True)
        return tiny.random_model(a.model, device=str(dev), dtype=dtype)
    model = load_model(a.model, device=a.device, dtype=a.dtype)
    print(check_fits(model, tokens, caches=4), flush=True)
    return model


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    problem = preflight(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)

    malloc = "keep" if a.malloc == "keep" and keep_freed_memory() else "default"
    try:
        model = load(a)
    except (MemoryBudgetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"model": a.model, "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
            "threads": torch.get_num_threads(), "reps": a.reps, "warmup": a.warmup, "clock": a.clock,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "malloc": malloc, "torch": torch.__version__,
            "weights": "random" if a.random_init else "loaded", "memory_cap_gib": a.memory_cap_gib}
    if model.device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(model.device)
    git = git_state()  # the commit the numbers come from, and whether the tree was clean
    meta |= {"commit": git["commit"], "dirty": git["dirty"], "cpu": cpu_model()}
    print(" ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as store:
        for n in a.lengths:
            paths: list[Timed] = []
            info: dict[str, Any] = {"estimate_gib": estimate_peak_bytes(model, n, caches=4) / 2**30,
                                    "weights_gib": model_bytes(model.hf) / 2**30}
            if "edit" in a.only:
                p, i = edit_paths(model, n, a.map, a.attribution)
                paths += p
                info.update(i)
            if "ttft" in a.only:
                p, i = ttft_paths(model, n, Path(store))
                paths += p
                info.update(i)
            if "multiblock" in a.only:
                p, i = multiblock_paths(model, n, Path(store))
                paths += p
                info.update(i)
            run_rounds(paths, a.reps, a.warmup, model.device, a.clock)
            rows.append({**summarize(n, paths, info), **meta})
            if a.kvboost and "multiblock" in a.only:  # after ours, in the same run: one job at a time
                rows[-1].update(kvboost_multiblock(model, n, a.kvboost, a.reps))
            if a.profile:
                rows[-1]["profile"] = profile_paths(paths, n, Path(a.profile))
                for name, top in rows[-1]["profile"].items():
                    print(f"profile L={n} {name}: " + "; ".join(
                        f"{e['op']} {100 * e['self_cpu_share']:.0f}%" for e in top[:6]), flush=True)
            print(table(rows[-1:]), flush=True)
            if a.json:  # after every length: a run cut short keeps the lengths it finished
                Path(a.json).write_text(json.dumps(rows, indent=1))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
