"""Experiment `memory`: a user memory after the trajectory, edited with an erratum, transplanted.

Synthetic items (kvnotes.tasks suite `memory`): a conversation log (the trajectory), then a
profile block holding one mutable fact, then a question the fact decides. The memory block is
precompiled alone; when the fact changes, the stale block is transplanted after the trajectory
(RoPE reposition + seam repair K) and an erratum line (`[STATE UPDATE] <fact> has changed to
<new>; ...`) is appended after it, so only the seam, the erratum and the question are computed:
O(L) instead of a full recompute. Conditions, each against its full-recompute reference:
transplant (unchanged fact, vs full old), transplant + erratum (vs full new: the headline, and
vs full prefill of the same erratum prompt: transplant fidelity), full + erratum (vs full new:
the erratum alone), transplant of the block re-prefilled with the new value (vs full new).

LoCoMo (`locomo_path`: the official locomo10.json, never downloaded): each conversation is the
memory block (cut to `locomo_max_tokens` at a turn boundary), transplanted after the system
head; answerable questions with all evidence inside it are answered greedily from the
transplanted and the fully recomputed cache: answer agreement, LoCoMo token F1 of both, cosine.
The F1 delta carries, beside the question bootstrap, `ci_cluster`: the bootstrap over whole
conversations (the questions of one conversation share its memory block).

    python -m experiments.run +experiment=memory model=llama device=cpu \
        experiment.locomo_path=/work/shared/data/locomo/locomo10.json
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from experiments.shared.compare import compare
from experiments.shared.gate import GateConfig, gate_summary, run_gate
from kvnotes.compose import splice as compose
from kvnotes.engine import run as engine
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import ci_dict, cluster_bootstrap_ci, prop_dict
from kvnotes.measure.timing import torch_threads
from kvnotes.tasks import build_suite, locomo
from kvnotes.tasks.domains import banks
from kvnotes.tasks.tokens import encode, frame

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.models import LoadedModel
    from kvnotes.tasks import TaskItem
    from kvnotes.tasks.locomo import Conversation

LOCOMO_INTRO = "You are a personal assistant. Answer from the conversation memory below.\n\n"
LOCOMO_TASK = "Answer in a few words."


LOCOMO_AROUND = 256  # tokens of system prompt + question around a LoCoMo memory block (bound)


@dataclass
class MemoryConfig:
    """Synthetic memory items, the seam, and the optional LoCoMo QA."""

    n_items: int = 20
    length: int = 600  # tokens per synthetic prompt
    seam: int = 4
    locomo_path: str | None = None  # the official locomo10.json (or a file of that format)
    locomo_conversations: int | None = None  # first n conversations; None: all
    locomo_max_tokens: int = 2000  # memory block budget per conversation (cut at a turn)
    locomo_questions: int | None = 20  # per conversation, in file order; None: all covered
    max_new_tokens: int = 12
    threads: int | None = None  # torch CPU threads (None: unchanged; 1 is faster on a shared CPU)
    gate: GateConfig = field(default_factory=GateConfig)
    n_boot: int = 1000

    def __post_init__(self) -> None:
        if self.n_items < 0 or self.length < 1 or self.seam < 0:
            raise ConfigError("n_items >= 0, length >= 1 and seam >= 0 are needed")
        if self.locomo_max_tokens < 16 or self.max_new_tokens < 1:
            raise ConfigError("locomo_max_tokens >= 16 and max_new_tokens >= 1 are needed")

    def suite_lengths(self) -> list[tuple[str, str, int, int]]:
        """(setting, suite, n_items, length) of the suite this job builds (runner's pre-flight)."""
        return [("length", "memory", self.n_items, self.length)] if self.n_items else []

    def longest_prompt(self) -> tuple[str, int, int]:
        """The longest prompt and the greedy answer generated after it, for the position check: a
        synthetic prompt of `length` tokens, or with LoCoMo a memory block of `locomo_max_tokens`
        with the system prompt and question around it (bound: LOCOMO_AROUND tokens)."""
        if self.locomo_path and self.locomo_max_tokens + LOCOMO_AROUND > self.length:
            return "locomo_max_tokens", self.locomo_max_tokens, LOCOMO_AROUND + self.max_new_tokens
        return "length", self.length, self.max_new_tokens


def erratum_text(field_name: str, value: str) -> str:

    return banks()["agent"]["update"].format(field=field_name, value=value) + "\n"


def synthetic(model: LoadedModel, item: TaskItem, seam: int) -> list[dict[str, Any]]:
    """One record per condition of a memory item (see the module docstring)."""

    s, e = item.segments["memory"]
    if not s <= item.field_span[0] < item.field_span[1] <= e:
        raise ValueError(f"{item.item_id}: the mutable fact is not inside the memory segment")
    old, new = list(item.old_ids), list(item.new_ids)
    head, tail = old[:s], old[e:]
    err = encode(model.tokenizer, erratum_text(item.field_name, item.new_value))

    def last(ids: list[int]) -> Any:  # last-position logits of a clean prefill, [vocab]
        return engine.prefill(model, ids).logits[0, -1]

    full_old, full_new, full_err = last(old), last(new), last(head + old[s:e] + err + tail)
    prefix = engine.prefill(model, head).cache
    stale = compose.transplant(model, prefix, compose.prefill_block(model, old[s:e]), seam)
    edited = compose.transplant(model, prefix, compose.prefill_block(model, new[s:e]), seam)
    tp_old = engine.extend(model, stale, tail).logits[0, -1]
    tp_err = engine.extend(model, stale, err + tail).logits[0, -1]
    tp_edit = engine.extend(model, edited, tail).logits[0, -1]
    want = {"old": item.correct_old, "new": item.correct_new}
    n_mem, n_tail = e - s, len(tail)
    conditions = [  # (condition, logits, reference name, reference logits, expected, recomputed)
        ("transplant", tp_old, "full_old", full_old, "old", min(seam, n_mem) + n_tail),
        ("transplant_erratum", tp_err, "full_new", full_new, "new", min(seam, n_mem) + len(err) + n_tail),
        ("transplant_erratum", tp_err, "full_erratum", full_err, "new", min(seam, n_mem) + len(err) + n_tail),
        ("full_erratum", full_err, "full_new", full_new, "new", len(old) + len(err)),
        ("transplant_edit", tp_edit, "full_new", full_new, "new", n_mem + min(seam, n_mem) + n_tail),
        ("full_old", full_old, "full_new", full_new, "new", len(old)),
    ]
    rows = []
    for name, logits, ref_name, ref, expected, recomputed in conditions:
        cmp = compare(logits, ref, item.decision_ids)
        correct = item.decision_ids[item.outcomes.index(want[expected])]
        rows.append({
            "kind": "synthetic", "item_id": item.item_id, "domain": item.domain,
            "condition": name, "reference": ref_name, **cmp,
            "correct": cmp["decision"] == correct, "correct_ref": cmp["decision_ref"] == correct,
            "n_tokens": len(old), "memory_len": n_mem, "recomputed": recomputed,
        })
    return rows


def locomo_conversation(
    model: LoadedModel, conv: Conversation, cfg: MemoryConfig, chat: bool
) -> list[dict[str, Any]]:
    """LoCoMo QA on one conversation: transplanted vs fully recomputed memory, greedy answers."""

    tok = model.tokenizer
    fr = frame(tok, chat)
    mem = locomo.render_memory(conv, tok, cfg.locomo_max_tokens)
    qs = locomo.questions(conv, mem.dia_ids)
    if cfg.locomo_questions is not None:
        qs = qs[: cfg.locomo_questions]
    if not qs:
        return []
    prefix_ids = encode(tok, fr.head + LOCOMO_INTRO)
    block = [i for p in mem.pieces for i in encode(tok, p)]
    prefix = engine.prefill(model, prefix_ids).cache
    full_ctx = engine.extend(model, prefix, block).cache  # the full recompute of the context
    tp_ctx = compose.transplant(model, prefix, compose.prefill_block(model, block), cfg.seam)
    stops = sorted(set(getattr(tok, "all_special_ids", []) or []))
    rows = []
    for j, q in enumerate(qs):
        tail = encode(tok, fr.mid + f"Question: {q.question}\n{LOCOMO_TASK}" + fr.tail + "Answer:")
        full_ids, full_first = compose.greedy(model, full_ctx, tail, cfg.max_new_tokens, stops)
        tp_ids, tp_first = compose.greedy(model, tp_ctx, tail, cfg.max_new_tokens, stops)
        full_ans = tok.decode(full_ids).strip().split("\n")[0].strip()
        tp_ans = tok.decode(tp_ids).strip().split("\n")[0].strip()
        cmp = compare(tp_first, full_first, (int(full_first.argmax()),))
        gold = str(q.answer)
        rows.append({
            "kind": "locomo", "conversation": conv.sample_id, "question_index": j,
            "category": q.category, "question": q.question, "gold": gold,
            "answer_full": full_ans, "answer_transplant": tp_ans,
            "answer_agree": locomo.normalize(full_ans) == locomo.normalize(tp_ans),
            "f1_full": locomo.f1(full_ans, gold), "f1_transplant": locomo.f1(tp_ans, gold),
            "cosine": cmp["cosine"], "top1_agree": cmp["top1_agree"], "kl": cmp["kl"],
            "memory_len": len(block), "turns_in_memory": len(mem.dia_ids),
        })
    return rows


def summarize(records: list[dict[str, Any]], cfg: MemoryConfig) -> dict[str, Any]:
    """Per condition/reference: decision agreement, cosine, accuracy; LoCoMo: agreement, F1, cosine."""
    df = pd.DataFrame(records)
    out: dict[str, Any] = {"gate": gate_summary(df, cfg.gate), "seam": cfg.seam}
    kind = df["kind"] if "kind" in df.columns else pd.Series([], dtype=str)
    syn, lo = df[kind == "synthetic"], df[kind == "locomo"]
    if len(syn):
        out["n_items"] = int(syn["item_id"].nunique())
        out["synthetic"] = {
            f"{c} vs {r}": {
                "decision_agree": prop_dict(g["decision_agree"].astype(float)),
                "cosine": ci_dict(g["cosine"], cfg.n_boot),
                "kl": ci_dict(g["kl"], cfg.n_boot),
                "accuracy": prop_dict(g["correct"].astype(float)),
                "accuracy_ref": prop_dict(g["correct_ref"].astype(float)),
                "recompute_fraction": float((g["recomputed"] / g["n_tokens"]).mean()),
            }
            for (c, r), g in syn.groupby(["condition", "reference"], sort=False)
        }
    if len(lo):
        delta = np.asarray(lo["f1_transplant"], float) - np.asarray(lo["f1_full"], float)
        by_conv = cluster_bootstrap_ci(delta, list(lo["conversation"]), n_boot=cfg.n_boot)  # questions share one
        out["locomo"] = {
            "n_questions": len(lo), "n_conversations": int(lo["conversation"].nunique()),
            "memory_len_mean": float(lo["memory_len"].mean()),
            "answer_agree": prop_dict(lo["answer_agree"].astype(float)),
            "f1_full": ci_dict(lo["f1_full"], cfg.n_boot),
            "f1_transplant": ci_dict(lo["f1_transplant"], cfg.n_boot),
            "f1_delta": ci_dict(delta, cfg.n_boot) | {"ci_cluster": {"cluster": "conversation", **{
                k: v for k, v in by_conv.items() if k not in ("mean", "interval")}}},
            "cosine": ci_dict(lo["cosine"], cfg.n_boot),
            "top1_agree": prop_dict(lo["top1_agree"].astype(float)),
        }
    return out


def run(ctx: Context) -> None:
    cfg: MemoryConfig = ctx.params
    with torch_threads(cfg.threads):
        run_gate(ctx, cfg.gate)
        run_units(ctx, cfg)


def run_units(ctx: Context, cfg: MemoryConfig) -> None:

    chat = ctx.chat
    if cfg.n_items:
        items = build_suite("memory", tokenizer=ctx.model.tokenizer, chat=chat, n_items=cfg.n_items,
                            length=cfg.length, seed=ctx.cfg.seed)
        units = {f"item-{it.item_id}": it for it in items}
        for key in ctx.pending(list(units), desc="memory items"):
            ctx.write(key, synthetic(ctx.model, units[key], cfg.seam))
    if cfg.locomo_path:
        convs = locomo.load(cfg.locomo_path)[: cfg.locomo_conversations]
        by_key = {f"locomo-{c.sample_id or i}": c for i, c in enumerate(convs)}
        for key in ctx.pending(list(by_key), desc="locomo conversations"):
            ctx.write(key, locomo_conversation(ctx.model, by_key[key], cfg, chat))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "memory"
CONFIG = MemoryConfig
HELP = "user memory edited by erratum and transplanted vs full recompute; LoCoMo QA"
