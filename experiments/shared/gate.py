"""The composition gate the composition experiments run first (selfcheck, compose,
compose_scaling, memory, agent): probe blocks spliced after a prefix with K seam tokens
repaired (`kvnotes.compose.splice.self_check`), compared with a full recompute; a failed gate
stops the experiment unless it is told to record anyway (never a silent fallback).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

from kvnotes.compose import splice
from kvnotes.errors import ConfigError

if TYPE_CHECKING:
    from experiments.shared.context import Context

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


def texts(index: int, seed: int, prefix_sentences: int = 4, block_sentences: int = 8) -> tuple[str, str]:
    """(prefix, block) for probe block `index`: disjoint seeded draws from SENTENCES."""
    rng = random.Random(seed * 1_000_003 + index)
    n = prefix_sentences + block_sentences
    draw = [SENTENCES[i % len(SENTENCES)] for i in rng.sample(range(max(n, len(SENTENCES))), n)]
    prefix = PREFIX_HEAD + " ".join(draw[:prefix_sentences]) + "\n"
    block = BLOCK_HEAD.format(i=index + 1) + " ".join(draw[prefix_sentences:])
    return prefix, block


def encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


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
    tok, model = ctx.model.tokenizer, ctx.model
    dtype = str(model.dtype).removeprefix("torch.")
    for key in ctx.pending([GATE], desc="gate"):
        rows = []
        for i in range(gate.n_blocks):
            prefix, block = texts(i, ctx.cfg.seed)
            b = encode(tok, block, special=False)
            seams = sorted({min(k, len(b)) for k in gate.seams})
            for r in splice.self_check(model, encode(tok, prefix, True), b, encode(tok, QUESTION, False),
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
