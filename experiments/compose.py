"""Experiment `compose`: fidelity of transplanted skills against a full recompute, per seam K.

Each skills item (kvnotes.tasks, suite `skills`) is a prompt of several skill blocks, then a
question one skill decides. Reference: a clean prefill of the whole prompt. Composed: the prompt
head prefilled, every skill block prefilled alone at positions 0..L-1, RoPE-repositioned to where
it lands and spliced with its first K tokens recomputed (`compose.transplant`), then the
question run on top. Per item and K: full-vocabulary logit cosine at the last position, top-1
agreement, KL(full || composed) and decision agreement (argmax over the outcome tokens); the
summary is the seam-repair curve, overall and per skill domain, each with n and a bootstrap CI.
A correctness gate (`compose.self_check` on probe blocks) runs first and is recorded.

    python -m experiments.run +experiment=compose model=llama
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from experiments.shared.compare import compare
from experiments.shared.gate import GateConfig, gate_summary, run_gate
from kvnotes.compose import splice as compose
from kvnotes.engine import run as engine
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import ci_dict, prop_dict
from kvnotes.measure.timing import torch_threads
from kvnotes.tasks import build_suite

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.models import LoadedModel
    from kvnotes.tasks import TaskItem

log = logging.getLogger(__name__)
SEAMS = [0, 1, 2, 4, 8, 16, 32]


@dataclass
class ComposeConfig:
    """Skills items, seams and the gate. `length` is tokens per prompt (suite `skills`)."""

    n_items: int = 20  # round-robin over the skills, alternating question value
    length: int = 600
    seams: list[int] = field(default_factory=lambda: list(SEAMS))
    noise_floor: bool = True  # also compare a seam covering every block (chunked full recompute)
    gate: GateConfig = field(default_factory=GateConfig)
    threads: int | None = None  # torch CPU threads (None: unchanged; 1 is faster on a shared CPU)
    n_boot: int = 1000

    def __post_init__(self) -> None:
        if self.n_items < 1 or self.length < 1:
            raise ConfigError("n_items and length must be >= 1")
        if not self.seams or any(k < 0 for k in self.seams):
            raise ConfigError(f"seams must be a non-empty list of ints >= 0, got {self.seams}")

    def suite_lengths(self) -> list[tuple[str, str, int, int]]:
        """(setting, suite, n_items, length) of the suite this job builds (runner's pre-flight)."""
        return [("length", "skills", self.n_items, self.length)]

    def longest_prompt(self) -> tuple[str, int, int]:
        """Tokens per prompt, for the position check (the question is inside `length`)."""
        return "length", self.length, 0


def split_item(item: TaskItem, prefix_name: str = "skill:") -> tuple[list[int], list[tuple[str, list[int]]], list[int]]:
    """(head ids, [(segment, block ids)], tail ids) of a prompt whose blocks are adjacent segments."""
    ids = list(item.old_ids)
    blocks = sorted((s, e, name) for name, (s, e) in item.segments.items() if name.startswith(prefix_name))
    if not blocks:
        raise ValueError(f"{item.item_id}: no {prefix_name}* segments")
    for (_, e, _), (s, _, _) in zip(blocks, blocks[1:]):
        if e != s:
            raise ValueError(f"{item.item_id}: blocks are not adjacent ({e} != {s})")
    head, tail = ids[: blocks[0][0]], ids[blocks[-1][1] :]
    return head, [(name, ids[s:e]) for s, e, name in blocks], tail


def fidelity(
    model: LoadedModel, item: TaskItem, seams: list[int], floor: bool = False
) -> list[dict[str, Any]]:
    """One record per seam K: the composed prompt vs a full recompute of the same tokens.

    `floor` adds a row (kind "floor") whose seam covers every block: the same tokens recomputed
    in a different chunking, i.e. the numerical noise floor of the comparison in this dtype.
    """

    head, blocks, tail = split_item(item)
    ref = engine.prefill(model, list(item.old_ids)).logits[0, -1]  # [vocab]
    prefix = engine.prefill(model, head).cache if head else None
    blks = [compose.prefill_block(model, b) for _, b in blocks]
    lens = [len(b) for b in blks]
    rows = []
    runs = [("fidelity", k) for k in seams] + ([("floor", max(lens))] if floor else [])
    for kind, k in runs:
        cache = compose.transplant(model, prefix, blks, k)
        logits = engine.extend(model, cache, tail).logits[0, -1]
        rows.append({
            "kind": kind, "item_id": item.item_id, "domain": item.domain, "seam": int(k),
            **compare(logits, ref, item.decision_ids),
            "n_tokens": item.n_tokens, "n_blocks": len(blks), "block_len_mean": float(np.mean(lens)),
            "recomputed": sum(min(k, n) for n in lens) + len(tail),
        })
    correct = item.decision_ids[item.outcomes.index(item.correct_old)]
    for r in rows:
        r["correct_ref"] = r["decision_ref"] == correct
        r["correct"] = r["decision"] == correct
    return rows


def summarize(records: list[dict[str, Any]], cfg: ComposeConfig) -> dict[str, Any]:
    """The seam-repair curve: per K (and per K and domain) cosine, top-1, KL, decisions."""
    df = pd.DataFrame(records)
    out: dict[str, Any] = {"gate": gate_summary(df, cfg.gate)}
    fid = df[df["kind"] == "fidelity"] if "kind" in df else df.iloc[:0]
    if not len(fid):
        return out

    def stats(g: pd.DataFrame) -> dict[str, Any]:
        return {
            "cosine": ci_dict(g["cosine"], cfg.n_boot),
            "top1_agree": prop_dict(g["top1_agree"].astype(float)),
            "kl": ci_dict(g["kl"], cfg.n_boot),
            "decision_agree": prop_dict(g["decision_agree"].astype(float)),
            "accuracy": prop_dict(g["correct"].astype(float)),
            "accuracy_full": prop_dict(g["correct_ref"].astype(float)),
        }

    out["n_items"] = int(fid["item_id"].nunique())
    out["n_tokens_mean"] = float(fid["n_tokens"].mean())
    out["seams"] = {str(int(k)): stats(g) for k, g in fid.groupby("seam")}
    floor = df[df["kind"] == "floor"]
    if len(floor):  # the dtype's noise floor: every block token recomputed, chunked differently
        out["noise_floor"] = stats(floor)
    out["domains"] = {
        d: {str(int(k)): {"cosine": float(gk["cosine"].mean()),
                          "decision_agree": float(gk["decision_agree"].mean()), "n": len(gk)}
            for k, gk in g.groupby("seam")}
        for d, g in fid.groupby("domain")
    }
    return out


def run(ctx: Context) -> None:
    cfg: ComposeConfig = ctx.params
    with torch_threads(cfg.threads):
        run_gate(ctx, cfg.gate)
        fidelity_units(ctx, cfg)


def fidelity_units(ctx: Context, cfg: ComposeConfig) -> None:

    chat = ctx.chat
    items = build_suite("skills", tokenizer=ctx.model.tokenizer, chat=chat, n_items=cfg.n_items,
                        length=cfg.length, seed=ctx.cfg.seed)
    units = {f"item-{it.item_id}": it for it in items}
    for key in ctx.pending(list(units), desc="compose items"):
        ctx.write(key, fidelity(ctx.model, units[key], sorted(set(cfg.seams)), cfg.noise_floor))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "compose"
CONFIG = ComposeConfig
HELP = "transplanted skills vs full recompute per seam K and skill domain (seam curve)"
