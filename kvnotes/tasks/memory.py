"""User-memory items: a conversation log, then a long profile holding one mutable fact.

The memory block sits after the trajectory (the placement the paper edits and transplants at
O(L)): segment `trajectory` is the log, segment `memory` the profile, whose one mutable fact
(old/new values, token-aligned) decides the answer to the closing question. Neutral profile
lines and log events pad the prompt to the requested length.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.domains import bank
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.templates import Suite
from kvnotes.tasks.tokens import Frame, Piece, assemble, rendered_fields

INTRO = "You are a personal assistant. Answer from the user memory below."
TASK = "Reply with the answer only, in one word."
ANSWER_PREFIX = "Answer:"
CONTENT_FREE = " N/A"


@dataclass(frozen=True)
class Fact:
    name: str
    values: tuple[str, str]
    outcomes: tuple[str, str]
    question: str


def facts() -> dict[str, Fact]:
    return {
        n: Fact(n, tuple(d["values"]), tuple(d["outcomes"]), d["question"])
        for n, d in bank("memory")["facts"].items()
    }


def fact_names() -> list[str]:
    return sorted(facts())


def _events(rng: random.Random) -> Iterator[str]:
    b = bank("memory")
    slots = {k: list(v) for k, v in b["slots"].items()}
    lines = [line for t in b["events"] for line in filler._expand(t, slots)]
    yield from rng.sample(lines, len(lines))


def _profile(rng: random.Random) -> Iterator[str]:
    items = list(bank("memory")["profile"].items())
    rng.shuffle(items)
    for k, vals in items:
        yield f"{k}: {rng.choice(vals)}"


def _pieces(fact: Fact, value: int, fr: Frame, log: list[str], profile: list[str],
            slot: int) -> list[Piece]:
    mem = [Piece(line, "memory") for line in profile]
    field = [Piece(f"{fact.name}:", "memory"),
             Piece(" " + fact.values[value], "memory", " " + fact.values[1 - value], CONTENT_FREE),
             Piece("\n", "memory")]
    mem[slot:slot] = field
    out = [Piece(fr.head, "head"), Piece(INTRO + "\n\n", "intro"),
           Piece("## Conversation log\n", "trajectory"), *[Piece(e, "trajectory") for e in log],
           Piece("\n## User memory\n", "memory"), *mem,
           Piece(fr.mid, "turn_user"), Piece(fact.question + "\n", "question"), Piece(TASK, "task"),
           Piece(fr.tail, "turn_answer"), Piece(ANSWER_PREFIX + fr.answer_sep, "answer_prefix")]
    return [p for p in out if p.text]


def _fact(suite: Suite, index: int) -> tuple[Fact, int]:
    """Item `index`'s fact (round-robin) and its old value (alternating)."""
    bank_ = facts()
    names = list(suite.options.get("facts") or sorted(bank_))
    return bank_[names[index % len(names)]], (index // len(names)) % 2


def memory_skeleton_length(suite: Suite, tok: Any, fr: Frame, index: int, seed: int) -> int:
    """Tokens of item `index` without filler: the least `length` `build_memory_item` renders it
    at (`seed` does not move it: the seeded parts are filler)."""
    fact, value = _fact(suite, index)
    return len(assemble(tok, _pieces(fact, value, fr, [], [], 0)).old_ids)


def build_memory_item(suite: Suite, tok: Any, fr: Frame, index: int, length: int, seed: int) -> TaskItem:
    """Item `index`: fact round-robin, old value alternating, fact line at a seeded slot."""
    fact, value = _fact(suite, index)
    rng = random.Random(f"{suite.name}:{seed}:{index}")
    base = memory_skeleton_length(suite, tok, fr, index, seed)
    if length < base:
        raise ValueError(f"length {length} is below the {base} tokens memory item {index} needs")
    budget = length - base
    profile = filler.fit(tok, _profile(rng), budget // 3, fmt="{}\n")
    used = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in profile)
    log = filler.fit(tok, itertools.chain(_events(rng), filler.filler_stream(rng)), budget - used)
    slot = rng.randint(0, len(profile))
    a = assemble(tok, _pieces(fact, value, fr, log, profile, slot))
    return TaskItem(
        item_id=f"{suite.name}/s{seed}/L{length}/{index:04d}/{fact.name}",
        suite=suite.name,
        domain=fact.name,
        template_id=f"{fact.name}/slot{min(slot, 3)}",
        seed=seed,
        variant="field",
        field_name=fact.name,
        old_value=fact.values[value],
        new_value=fact.values[1 - value],
        correct_old=fact.outcomes[value],
        correct_new=fact.outcomes[1 - value],
        **rendered_fields(tok, a, fact.outcomes, fr.chat),
        meta={"length": length, "profile_lines": len(profile) + 1, "log_lines": len(log)},
    )
