"""Experiment `selfcheck`: the composition correctness gate on a real model.

Each probe block is a seeded draw of policy sentences (~100-200 tokens), prefilled alone,
RoPE-repositioned after a prefix and spliced with its first K tokens recomputed
(`kvnotes.compose.splice.self_check`). Its last-position logits after a short question are compared
with a full recompute: cosine, top-1 agreement, KL. A seam K passes when its mean cosine is
>= `threshold`; the gate passes when every K passes and both exactness checks (prefill + extend
vs a cache-free forward, K = L splice vs full prefill cache) are within the dtype's tolerance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from experiments.shared.gate import ATOL, QUESTION, encode, texts
from kvnotes.compose import splice
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import bootstrap_ci, proportion_ci

if TYPE_CHECKING:
    from experiments.shared.context import Context

log = logging.getLogger(__name__)


@dataclass
class SelfcheckConfig:
    """The composition gate: splice a block after a prefix, repair K seam tokens, compare."""

    n_blocks: int = 4  # probe blocks, each a seeded draw of policy sentences
    block_sentences: int = 8  # sentences per block (~100-200 tokens)
    prefix_sentences: int = 4  # sentences in the prefix the block is spliced after
    seams: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8, 16])
    threshold: float = 0.95  # a seam passes when its mean logit cosine is >= this
    atol: float | None = None  # exactness tolerance on logits/cache; None: by dtype
    n_boot: int = 1000

    def __post_init__(self) -> None:
        if self.n_blocks < 1 or self.block_sentences < 1 or self.prefix_sentences < 1:
            raise ConfigError("n_blocks, block_sentences and prefix_sentences must be >= 1")
        if not self.seams or any(k < 0 for k in self.seams):
            raise ConfigError(f"seams must be a non-empty list of ints >= 0, got {self.seams}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError(f"threshold is a cosine in [-1, 1], got {self.threshold}")


def summarize(records: list[dict[str, Any]], cfg: SelfcheckConfig) -> dict[str, Any]:
    """Per seam: mean cosine with a bootstrap CI, top-1 agreement, KL, pass; then the gate."""
    df = pd.DataFrame(records)
    seams: dict[str, Any] = {}
    for k, g in df.groupby("seam", sort=True):
        mean, lo, hi, n = bootstrap_ci(g["cosine"], n_boot=cfg.n_boot)
        agree, alo, ahi, _ = proportion_ci(g["top1_agree"].astype(float))  # Wilson: a share of blocks
        seams[str(k)] = {
            "cosine": mean, "cosine_lo": lo, "cosine_hi": hi, "n": n,
            "top1_agree": agree, "top1_lo": alo, "top1_hi": ahi,
            "kl": float(np.nanmean(g["kl"])),
            "pass": bool(mean >= cfg.threshold),
        }
    dtype = str(df["dtype"].iloc[0])
    atol = cfg.atol if cfg.atol is not None else ATOL.get(dtype, 1e-3)
    exact = {
        "max_abs_diff_extend": float(df["max_abs_diff_extend"].max()),
        "max_abs_diff_splice_full": float(df["max_abs_diff_splice_full"].max()),
        "atol": atol,
    }
    exact["pass"] = bool(max(exact["max_abs_diff_extend"], exact["max_abs_diff_splice_full"]) <= atol)
    return {
        "threshold": cfg.threshold,
        "n_blocks": int(df["block"].nunique()),
        "block_len_mean": float(df["block_len"].mean()),
        "seams": seams,
        "exact": exact,
        "pass": bool(exact["pass"] and all(s["pass"] for s in seams.values())),
    }




def run(ctx: Context) -> None:
    """Composition gate: spliced block + seam repair vs full recompute, per seam K."""
    cfg: SelfcheckConfig = ctx.params
    tok = ctx.model.tokenizer
    question = encode(tok, QUESTION, special=False)
    dtype = str(ctx.model.dtype).removeprefix("torch.")
    units = {f"block-{i:03d}": i for i in range(cfg.n_blocks)}
    for key in ctx.pending(list(units), desc="selfcheck blocks"):
        index = units[key]
        prefix_text, block_text = texts(index, ctx.cfg.seed, cfg.prefix_sentences, cfg.block_sentences)
        block = encode(tok, block_text, special=False)
        seams = sorted({min(k, len(block)) for k in cfg.seams})
        rows = splice.self_check(ctx.model, encode(tok, prefix_text, True), block, question, seams)
        ctx.write(key, [{"block": index, "dtype": dtype, **r} for r in rows])


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "selfcheck"
CONFIG = SelfcheckConfig
