"""kvboost (PyPI, MIT) in experiment `blend`, run as it ships: the job for its worker
(experiments/shared/kvboost_worker.py, in kvboost's own venv), and the worker's output scored like
our own methods.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvnotes.engine import run as engine
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import kl_divergence, logit_cosine, top1_agree
from kvnotes.tasks import locomo
from serving.guard import run_guarded

if TYPE_CHECKING:
    from experiments.shared.workloads import BlendItem
    from kvnotes.models import LoadedModel

ROOT = Path(__file__).resolve().parents[2]


def resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


@dataclass
class KvboostConfig:
    """kvboost (PyPI, MIT) run as it ships, from the python of its own venv."""

    enabled: bool = False
    python: str = ".venv-kvboost/bin/python"  # relative: to the repository root
    chunk_size: int = 64
    overlap: int = 16  # its "selective" strategy: last R tokens before each seam
    ratios: list[float] = field(default_factory=lambda: [0.15])  # its "cacheblend" strategy
    timeout_s: int = 3600

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.overlap < 0 or not all(0 < r <= 1 for r in self.ratios):
            raise ConfigError("kvboost: chunk_size >= 1, overlap >= 0 and ratios in (0, 1] are needed")


def kvboost_configs(kb: KvboostConfig) -> dict[str, dict[str, Any]]:
    return {f"selective@{kb.overlap}": {"strategy": "selective", "overlap": kb.overlap, "setting": kb.overlap},
            **{f"cacheblend@{round(r * 100)}%": {"strategy": "cacheblend", "ratio": r, "setting": r}
               for r in kb.ratios}}


def kvboost_records(model: LoadedModel, items: list[BlendItem], kb: KvboostConfig,
                    max_new_tokens: int) -> list[dict[str, Any]]:
    """kvboost's selective and cacheblend strategies on the same prompts (its own venv)."""
    tok = model.tokenizer
    confs = kvboost_configs(kb)
    texts = [{"key": f"i{j}", "text": tok.decode(it.layout.ids), "context_text": tok.decode(it.layout.context),
              "max_new_tokens": 1 if it.gold is None else max_new_tokens} for j, it in enumerate(items)]
    res, logits = run_worker(kb.python, model, confs, texts, kb.chunk_size, kb.timeout_s)
    return kvboost_rows(model, items, res, logits, confs)


def run_worker(python: str, model: LoadedModel, confs: dict[str, dict[str, Any]], items: list[dict[str, Any]],
               chunk_size: int, timeout_s: float
               ) -> tuple[list[dict[str, Any]], dict[tuple[str, str], torch.Tensor]]:
    """Run experiments/shared/kvboost_worker.py in kvboost's venv on `items` ({key, text, context_text,
    max_new_tokens}) with each of `confs` (name -> strategy settings): its result lines and the
    first-token logits per (key, config), the baseline (its full prefill) included. The worker
    runs under the watchdog (serving/guard.py): it and its children die with this process."""
    py = resolve(python)
    if not py.exists():
        raise RuntimeError(f"kvboost python {py} not found: python -m venv .venv-kvboost && "
                           ".venv-kvboost/bin/pip install torch==2.13.0 kvboost")
    job = {"model_path": model.source_path, "threads": torch.get_num_threads(), "chunk_size": chunk_size,
           "configs": [{"name": n, **c} for n, c in confs.items()], "items": items}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        proc = run_guarded([str(py), str(Path(__file__).with_name("kvboost_worker.py")), f"{tmp}/job.json",
                            f"{tmp}/out"], timeout=timeout_s)  # dies with this process, however it dies
        if proc.returncode != 0:
            raise RuntimeError(f"kvboost worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
        res = [json.loads(x) for x in (Path(tmp) / "out" / "results.jsonl").read_text().splitlines()]
        logits = {(r["key"], r["config"]): torch.from_numpy(np.load(Path(tmp) / "out" / r["logits"])) for r in res}
    return res, logits


def kvboost_rows(model: LoadedModel, items: list[BlendItem], res: list[dict[str, Any]],
                 logits: dict[tuple[str, str], torch.Tensor], confs: dict[str, dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """Records of the worker's output, scored like ours. Its recompute fraction counts what it
    ran through the model: uncached context tokens, plus every cached token when cacheblend ran
    (its step 1 re-prefills them all; approximate, i.e. content-only, matches force it), else
    `overlap` tokens per seam. cosine: against its own baseline (same tokens);
    cosine_vs_ours: against kvnotes' full prefill of its tokens."""

    base = {r["key"]: r for r in res if r["config"] == "baseline"}
    ours: dict[str, torch.Tensor] = {}
    rows = []
    for r in res:
        if r["config"] == "baseline":
            continue
        it, b, conf = items[int(r["key"][1:])], base[r["key"]], confs[r["config"]]
        x, ref = logits[(r["key"], r["config"])], logits[(r["key"], "baseline")]
        if r["key"] not in ours:
            ours[r["key"]] = engine.prefill(model, r["ids"]).logits[0, -1].cpu()
        ans = ""
        dec: int | str
        dec_ref: int | str
        if it.gold is None:
            ids = list(it.decision_ids)
            dec, dec_ref = ids[int(x[ids].argmax())], ids[int(ref[ids].argmax())]
            score, score_ref = float(dec == it.correct_id), float(dec_ref == it.correct_id)
        else:
            ans, ans_ref = (str(t).strip().split("\n")[0].strip() for t in (r["output_text"], b["output_text"]))
            dec, dec_ref = locomo.normalize(ans), locomo.normalize(ans_ref)
            score, score_ref = locomo.f1(ans, it.gold), locomo.f1(ans_ref, it.gold)
        n_ctx, cached = max(int(r["n_context"]), 1), int(r["cached_tokens"])
        blended = conf["strategy"] == "cacheblend" or r["approximate_hits"] > 0
        repair = cached if blended else min(cached, conf["overlap"] * max(r["warmed_chunks"] - 1, 0))
        rows.append({
            "kind": "blend", "workload": it.workload, "item_id": it.item_id, "domain": it.meta.get("domain", ""),
            "method": "kvboost-" + conf["strategy"], "setting": float(conf["setting"]),
            "name": "kvboost " + r["config"], "n_blocks": len(it.layout.blocks), "n_block_tokens": n_ctx,
            "n_context": n_ctx, "n_tail": len(r["ids"]) - n_ctx, "recomputed": min(n_ctx, n_ctx - cached + repair),
            "checked": 0, "cosine": float(logit_cosine(x, ref)), "top1_agree": bool(top1_agree(x, ref)),
            "kl": float(kl_divergence(ref, x)), "decision_agree": str(dec) == str(dec_ref),
            "task_score": score, "task_score_full": score_ref, "decision": str(dec), "decision_full": str(dec_ref),
            "answer": ans, "time_s": r["ttft_s"], "time_full_s": b["ttft_s"], "ttft_ratio": r["ttft_s"] / b["ttft_s"],
            "reported_ttft_ratio": r["reported_ttft_ms"] / b["reported_ttft_ms"],
            "kv_reuse_ratio": r["kv_reuse_ratio"], "approximate_hits": r["approximate_hits"],
            "cacheblend_forced": bool(conf["strategy"] != "cacheblend" and r["approximate_hits"] > 0),
            "same_tokens": r["ids"] == list(it.layout.ids),
            "cosine_vs_ours": float(logit_cosine(x, ours[r["key"]])),
            "baseline_cosine_vs_ours": float(logit_cosine(ref, ours[r["key"]])),
        })
        rows[-1]["recompute_fraction"] = rows[-1]["recomputed"] / n_ctx
    return rows
