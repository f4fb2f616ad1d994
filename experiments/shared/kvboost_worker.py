"""Run kvboost (PyPI, MIT) as it ships on prompts given by experiments/blend.py; its own venv.

    <kvboost venv>/bin/python experiments/shared/kvboost_worker.py job.json out_dir

This file imports only the standard library, numpy, torch, transformers and kvboost, so it runs
in the venv where kvboost and its dependencies live (never in the main environment). The model
is loaded in fp32 from the converted folder and handed to `KVBoost(model=...)` (its
`from_pretrained` forces fp16). Per item: the cache is reset; the context is warmed in one of two
ways, per config (`warm`):

* "chunks": every full chunk of the context (kvboost's own tokenization of the prompt text) is
  warmed alone at the position where it lands (`warm(text, position_offset=start)`). Each call
  restarts kvboost's hash chain, so every chunk after the first is a content-hash (approximate)
  match, and kvboost then forces CacheBlend whatever strategy was asked for (engine.py:868-879),
  whose first step re-prefills every cached token: <= 1x its own prefill by construction.
* "context": one `warm(context_text)`, as kvboost's README, docstring and benchmarks do: its
  chunks are hash-chained from token 0 and match exactly, so `none` and `selective` run as asked.

A config may set its own `chunk_size` and kvboost engine keywords (`engine`: chunk_boundary_window,
overlap_k, sink_tokens, recency_window_chunks, max_cache_bytes). Then `generate` runs in BASELINE
mode (its full prefill) and in CHUNK_KV_REUSE mode with each config. TTFT is wall clock from the call to the first `on_token` callback (its
reported ttft_ms starts after assembly and repair). Output: out_dir/results.jsonl, one line per
(item, config), and out_dir/<item>__<config>.npy, the first-token logits (fp32).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _timed(engine: Any, text: str, mode: Any, max_new: int) -> tuple[Any, float]:
    """(GenerationResult, seconds from the call to the first sampled token)."""
    first: list[float] = []
    t0 = time.perf_counter()
    res = engine.generate(text, max_new_tokens=max_new, mode=mode, do_sample=False,
                          on_token=lambda _t: first.append(time.perf_counter()) if not first else None)
    return res, (first[0] if first else time.perf_counter()) - t0


def main(job_path: str, out_dir: str) -> int:
    # deferred: this worker runs in kvboost's own venv (.venv-kvboost); nothing is imported at module level.
    # Python puts this file's folder first on the path, and it holds kvnotes' driver (kvboost.py):
    # drop it, or `import kvboost` finds the driver instead of the package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import numpy as np
    import torch
    from kvboost import GenerationMode, KVBoost
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(Path(job_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(job.get("threads") or 1))
    tok = AutoTokenizer.from_pretrained(job["model_path"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(job["model_path"], dtype=torch.float32)
    model.eval()
    def make(c: dict[str, Any]) -> tuple[Any, int, str]:
        size = int(c.get("chunk_size") or job["chunk_size"])
        kw = {"max_cache_bytes": int(job.get("max_cache_bytes", 2**31)), **c.get("engine", {})}
        eng = KVBoost(model=model, tokenizer=tok, chunk_size=size, recompute_strategy=c["strategy"],
                      recompute_ratio=float(c.get("ratio", 0.15)), recompute_overlap=int(c.get("overlap", 16)),
                      device="cpu", **kw)
        return eng, size, str(c.get("warm", "chunks"))

    engines = {c["name"]: make(c) for c in job["configs"]}
    with (out / "results.jsonl").open("w") as f:
        for item in job["items"]:
            ids = tok.encode(item["text"], add_special_tokens=True)
            n_ctx = len(tok.encode(item["context_text"], add_special_tokens=True))
            n_ctx = n_ctx if ids[:n_ctx] == tok.encode(item["context_text"], add_special_tokens=True) else 0
            max_new = int(item["max_new_tokens"])
            rows: list[tuple[str, Any, float, dict[str, Any]]] = []
            base = next(iter(engines.values()))[0]
            base.reset_cache()
            res, ttft = _timed(base, item["text"], GenerationMode.BASELINE, max_new)
            rows.append(("baseline", res, ttft, {}))
            for name, (eng, size, warm) in engines.items():
                eng.reset_cache()
                warmed = roundtrip = 0
                if warm == "context":  # one call: chunks hash-chained from token 0, exact hits
                    warmed, roundtrip = eng.warm(item["context_text"]).chunks_stored, int(n_ctx > 0)
                else:
                    for s in range(0, n_ctx - size + 1, size):
                        text = tok.decode(ids[s : s + size])
                        roundtrip += tok.encode(text, add_special_tokens=True) == ids[s : s + size]
                        eng.warm(text, position_offset=s)
                        warmed += 1
                hits0 = dict(eng.cache_manager.stats())
                res, ttft = _timed(eng, item["text"], GenerationMode.CHUNK_KV_REUSE, max_new)
                stats = eng.cache_manager.stats()
                extra = {"warmed_chunks": warmed, "roundtrip_chunks": roundtrip, "warm": warm, "chunk_size": size,
                         "approximate_hits": stats.get("approximate_hits", 0) - hits0.get("approximate_hits", 0),
                         # diagnostic: the store pass after decoding looks every chunk up again (counted twice)
                         "exact_hits": stats.get("cache_hits", 0) - hits0.get("cache_hits", 0)}
                rows.append((name, res, ttft, extra))
            for name, res, ttft, extra in rows:
                key = f"{item['key']}__{name}"
                np.save(out / f"{key}.npy", np.asarray(res.first_token_logits, dtype=np.float32))
                f.write(json.dumps({
                    "key": item["key"], "config": name, "ttft_s": ttft, "reported_ttft_ms": res.ttft_ms,
                    "output_text": res.output_text, "kv_reuse_ratio": res.kv_reuse_ratio,
                    "cached_tokens": res.cached_tokens, "prompt_tokens": res.prompt_tokens,
                    "n_context": n_ctx, "ids": ids, "logits": f"{key}.npy", **extra,
                }) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python experiments/shared/kvboost_worker.py job.json out_dir")
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
