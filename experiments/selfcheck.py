"""Experiment `selfcheck`: the composition correctness gate on a real model.

Each probe block is a seeded draw of policy sentences (~100-200 tokens), prefilled alone,
RoPE-repositioned after a prefix and spliced with its first K tokens recomputed
(`kvnotes.compose.self_check`). Its last-position logits after a short question are compared
with a full recompute: cosine, top-1 agreement, KL. A seam K passes when its mean cosine is
>= `threshold`; the gate passes when every K passes and both exactness checks (prefill + extend
vs a cache-free forward, K = L splice vs full prefill cache) are within the dtype's tolerance.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kvnotes.errors import ConfigError
from kvnotes.metrics import bootstrap_ci, proportion_ci

if TYPE_CHECKING:
    from experiments._context import Context

SENTENCES = (
    "Refunds are issued only for orders that have not yet shipped.",
    "Shipped orders must be escalated to a human agent before any money is returned.",
    "An account marked as suspended may not change its billing details.",
    "Verified administrators can reset passwords for any user in their organisation.",
    "Deployments to production require two approvals from the release team.",
    "Hotfixes may skip the staging environment only during a declared incident.",
    "Prescriptions for controlled substances need a signature from the attending physician.",
    "Loan applications above fifty thousand dollars are reviewed by a senior underwriter.",
    "Legal holds override every data retention rule until the hold is lifted.",
    "Incidents of severity one page the on-call engineer within five minutes.",
    "Visa applicants must present a passport valid for at least six months.",
    "Enterprise customers receive a dedicated support channel and a four-hour response time.",
    "Standard tier customers are answered within two business days.",
    "When safety mode is restricted, the assistant declines to run shell commands.",
    "Every tool call is logged together with the user request that triggered it.",
    "Customer data may be exported only to the customer who owns it.",
    "Discount codes cannot be combined with seasonal promotions.",
    "Orders cancelled within one hour of purchase are refunded automatically.",
    "Support agents must confirm the customer's identity before discussing an order.",
    "Invoices are sent on the first business day of each month.",
    "Accounts inactive for a year are archived after a written notice.",
    "Security reviews are mandatory for any change to the authentication service.",
    "Replacement items are shipped only after the original item is returned.",
    "Escalations must include the order number and a short summary of the problem.",
)
PREFIX_HEAD = "System: You are a careful operations assistant. Apply the rules below.\n"
BLOCK_HEAD = "Policy handbook, section {i}:\n"
QUESTION = "\nQuestion: a customer asks for a refund on an order that has shipped. Next action:"
ATOL = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}  # max |logit or K/V diff|, rough
GATE = "gate"  # unit key and `kind` of the correctness-gate records
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


def texts(index: int, seed: int, cfg: SelfcheckConfig) -> tuple[str, str]:
    """(prefix, block) for probe block `index`: disjoint seeded draws from SENTENCES."""
    rng = random.Random(seed * 1_000_003 + index)
    n = cfg.prefix_sentences + cfg.block_sentences
    draw = [SENTENCES[i % len(SENTENCES)] for i in rng.sample(range(max(n, len(SENTENCES))), n)]
    prefix = PREFIX_HEAD + " ".join(draw[: cfg.prefix_sentences]) + "\n"
    block = BLOCK_HEAD.format(i=index + 1) + " ".join(draw[cfg.prefix_sentences :])
    return prefix, block


def encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


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


# --- the gate the composition experiments run first (compose, compose_scaling, memory, agent) ---


@dataclass
class GateConfig:
    """Before trusting transplants: splice probe blocks, compare with a full recompute."""

    n_blocks: int = 2
    seams: list[int] = field(default_factory=lambda: [0, 4])
    threshold: float = 0.9  # the gate passes when every seam's mean cosine is >= this
    required: bool = True  # a failed gate stops the experiment (never a silent fallback)

    def __post_init__(self) -> None:
        if self.n_blocks < 1 or not self.seams or any(k < 0 for k in self.seams):
            raise ConfigError("gate: n_blocks >= 1 and a non-empty list of seams >= 0 are needed")
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError(f"gate.threshold is a cosine in [-1, 1], got {self.threshold}")


def run_gate(ctx: Context, gate: GateConfig) -> None:
    """Write the gate unit (one record per probe block and seam) and enforce it if required."""
    from kvnotes.compose import self_check

    tok, model = ctx.model.tokenizer, ctx.model
    dtype = str(model.dtype).removeprefix("torch.")
    for key in ctx.pending([GATE], desc="gate"):
        rows = []
        for i in range(gate.n_blocks):
            prefix, block = texts(i, ctx.cfg.seed, SelfcheckConfig())
            b = encode(tok, block, special=False)
            seams = sorted({min(k, len(b)) for k in gate.seams})
            for r in self_check(model, encode(tok, prefix, True), b, encode(tok, QUESTION, False),
                                seams):
                rows.append({"kind": GATE, "block": i, "dtype": dtype, **r})
        ctx.write(key, rows)
    verdict = gate_summary(ctx.read(), gate)
    log.info("composition gate: %s", verdict)
    if gate.required and not verdict["pass"]:
        raise RuntimeError(
            f"composition gate failed for {ctx.cfg.model.name}: {verdict}; transplants are not "
            f"trusted on this model (set experiment.gate.required=false to record anyway)"
        )


def gate_summary(df: pd.DataFrame, gate: GateConfig) -> dict[str, Any]:
    """Per seam mean cosine and top-1 agreement; exactness of K = L splicing; pass."""
    g = df[df["kind"] == GATE] if "kind" in df.columns else df.iloc[:0]
    if not len(g):
        return {"pass": False, "n": 0}
    seams = {str(int(k)): {"cosine": float(s["cosine"].mean()),
                           "top1_agree": float(s["top1_agree"].astype(float).mean()), "n": len(s)}
             for k, s in g.groupby("seam")}
    exact = float(max(g["max_abs_diff_extend"].max(), g["max_abs_diff_splice_full"].max()))
    atol = ATOL.get(str(g["dtype"].iloc[0]), 1e-3)
    ok = exact <= atol and all(s["cosine"] >= gate.threshold for s in seams.values())
    return {"pass": bool(ok), "threshold": gate.threshold, "max_abs_diff": exact, "atol": atol,
            "seams": seams}


def run(ctx: Context) -> None:
    """Composition gate: spliced block + seam repair vs full recompute, per seam K."""
    from kvnotes.compose import self_check

    cfg: SelfcheckConfig = ctx.params
    tok = ctx.model.tokenizer
    question = encode(tok, QUESTION, special=False)
    dtype = str(ctx.model.dtype).removeprefix("torch.")
    units = {f"block-{i:03d}": i for i in range(cfg.n_blocks)}
    for key in ctx.pending(list(units), desc="selfcheck blocks"):
        index = units[key]
        prefix_text, block_text = texts(index, ctx.cfg.seed, cfg)
        block = encode(tok, block_text, special=False)
        seams = sorted({min(k, len(block)) for k in cfg.seams})
        rows = self_check(ctx.model, encode(tok, prefix_text, True), block, question, seams)
        ctx.write(key, [{"block": index, "dtype": dtype, **r} for r in rows])


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "selfcheck"
CONFIG = SelfcheckConfig
