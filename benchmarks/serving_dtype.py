"""Which dtype does vLLM serve faster on this machine? One server per dtype, the same prompts.

    python -m benchmarks.serving_dtype --model qwen-1.5b --tokens 2000 --reps 4

Each dtype gets its own vLLM server (the serving venv, `bash scripts/serving_env.sh`), started
and always stopped; `reps` distinct prompts of about `tokens` words, each sent once (no prefix
cache hit), 4 generated tokens, greedy; TTFT by wall clock from the request to the first token.
Prints the median TTFT per dtype and the ratio, and whether this CPU computes bf16 natively. The
serving experiment's `dtype=auto` rule (experiments/serving.py: bf16 only with native bf16) comes
from this measurement on two CPUs: one with native bf16 (bf16 1.9x faster) and one with AVX2 only
(fp32 about 4.8x faster).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from kvnotes.measure.timing import native_bf16
from kvnotes.models import budget
from kvnotes.models.devices import DTYPES
from kvnotes.models.registry import UnknownModelError, get_spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvnotes.models import weights  # noqa: E402
from serving import client, server  # noqa: E402

WORDS = "alpha river stone cloud maple ticket harbor lantern copper violet meadow signal garden window".split()


def prompt(i: int, tokens: int) -> str:
    rnd = random.Random(i)
    return f"Request {i}. " + " ".join(rnd.choice(WORDS) for _ in range(tokens))


SERVER_ROOM = 2048  # max_model_len = tokens + this


def preflight(a: argparse.Namespace) -> str | None:
    """Why these arguments cannot run, before any weights are prepared or a server starts."""

    try:
        get_spec(a.model)
    except UnknownModelError as e:
        return f"--model: {e.args[0]}"
    bad = [d for d in a.dtypes.split(",") if d not in DTYPES]
    if bad:
        return f"--dtypes: unknown {', '.join(map(repr, bad))}; valid: {', '.join(DTYPES)}"
    if a.tokens < 1 or a.reps < 1:
        return "--tokens and --reps must be >= 1"
    shape = budget.model_shape(a.model, None, None)
    return budget.position_problem(a.tokens, a.model, shape, "--tokens", SERVER_ROOM) if shape else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen-1.5b")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--python", default=str(ROOT / ".venv-serving/bin/python"))
    p.add_argument("--log-dir", default="results/runs/serving_dtype")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    problem = preflight(a)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not Path(a.python).exists():
        print(f"error: {a.python} not found; run `bash scripts/serving_env.sh` first", file=sys.stderr)
        return 2
    path = weights.prepare(a.model)
    out: dict[str, dict[str, object]] = {}
    meds: dict[str, float] = {}
    for dtype in a.dtypes.split(","):
        spec = server.ServerSpec(python=a.python, model_path=str(path), served_name="m", dtype=dtype,
                                 max_model_len=a.tokens + SERVER_ROOM)
        s = server.Server(spec, Path(a.log_dir) / f"{a.model}_{dtype}.log")
        try:
            s.start()
            ttft = []
            for i in range(a.reps):
                c = client.complete_one(s.url, {"model": "m", "prompt": prompt(i, a.tokens), "max_tokens": 4,
                                                "temperature": 0})
                if c.status != "ok":
                    raise RuntimeError(f"{dtype}: request {i}: {c.error}")
                ttft.append(c.ttft_s)
            meds[dtype] = statistics.median(ttft)
            out[dtype] = {"startup_s": s.startup_s, "ttft_s": ttft, "median_s": meds[dtype]}
            print(f"{a.model} {dtype}: TTFT median {meds[dtype]:.2f} s over {a.reps} prompts "
                  f"of ~{a.tokens} words (min {min(ttft):.2f}, max {max(ttft):.2f})", flush=True)
        finally:
            s.stop()
    if len(meds) == 2:
        (d1, m1), (d2, m2) = meds.items()
        print(f"ratio {d1}/{d2}: {m1 / m2:.2f}")

    native = native_bf16("cpu")
    print(f"this CPU computes bf16 natively: {native}")
    if a.json:
        Path(a.json).write_text(json.dumps({"native_bf16": native, **out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
