"""Workloads of experiment `blend`: prompts cut into a cached head, reusable blocks and a tail.

* skills: the skills suite (kvnotes.tasks), its skill blocks in the suite's seeded order;
  scored by the decision (argmax over the outcome tokens).
* memory: RAG-style user memory; `n_blocks` memory notes of neutral profile lines and log
  events, one of which (at a seeded, varying place) holds the fact the closing question needs;
  scored by the decision.
* locomo: the official LoCoMo file, sessions as blocks (each cut at a turn boundary to
  `block_tokens`); per item one answerable question whose evidence lies in the chosen sessions,
  the other sessions drawn at random, the order permuted per item; scored by token F1 of a
  greedy answer.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any

from kvnotes.compose.blend import Layout
from kvnotes.tasks import build_suite, filler, locomo
from kvnotes.tasks.domains import bank
from kvnotes.tasks.memory import ANSWER_PREFIX, TASK, facts
from kvnotes.tasks.tokens import Piece, assemble, decision_ids, encode, frame

LOCOMO_INTRO = "You are a personal assistant. Answer from the conversation memory below.\n\n"
LOCOMO_TASK = "Answer in a few words."
MEMORY_INTRO = "You are a personal assistant. Answer from the user's memory notes below.\n\n"


@dataclass(frozen=True)
class BlendItem:
    """A prompt as a layout plus how its answer is scored (decision ids, or a gold answer)."""

    item_id: str
    workload: str
    layout: Layout
    decision_ids: tuple[int, ...] = ()
    correct_id: int | None = None
    gold: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _cut(ids: list[int], segments: dict[str, tuple[int, int]], prefix: str) -> Layout:
    spans = sorted((s, e) for name, (s, e) in segments.items() if name.startswith(prefix))
    for (_, e), (s, _) in zip(spans, spans[1:]):
        if e != s:
            raise ValueError(f"blocks are not adjacent ({e} != {s})")
    return Layout(tuple(ids[: spans[0][0]]), tuple(tuple(ids[s:e]) for s, e in spans),
                  tuple(ids[spans[-1][1] :]))


def skills_items(tok: Any, chat: bool, n: int, length: int, seed: int) -> list[BlendItem]:

    out = []
    for it in build_suite("skills", tokenizer=tok, chat=chat, n_items=n, length=length, seed=seed):
        lay = _cut(list(it.old_ids), dict(it.segments), "skill:")
        correct = it.decision_ids[it.outcomes.index(it.correct_old)]
        out.append(BlendItem(it.item_id, "skills", lay, tuple(it.decision_ids), correct,
                             meta={"domain": it.domain}))
    return out


def memory_items(tok: Any, chat: bool, n: int, n_blocks: int, block_tokens: int, seed: int) -> list[BlendItem]:
    """Item i: fact round-robin, value alternating, the fact's note at a seeded place."""

    fr = frame(tok, chat)
    bank_, b = facts(), bank("memory")
    names = sorted(bank_)
    slots = {k: list(v) for k, v in b["slots"].items()}
    events = [line for t in b["events"] for line in filler._expand(t, slots)]
    out = []
    for i in range(n):
        fact = bank_[names[i % len(names)]]
        value = (i // len(names)) % 2
        rng = random.Random(f"blend-memory:{seed}:{i}")
        target = rng.randrange(n_blocks)
        profile = [f"{k}: {rng.choice(v)}\n" for k, v in b["profile"].items()]
        rng.shuffle(profile)
        pieces = [Piece(fr.head, "head"), Piece(MEMORY_INTRO, "intro")]
        for j in range(n_blocks):
            seg = f"block:{j:02d}"
            own = profile[j::n_blocks]
            stream = itertools.chain(own, rng.sample(events, len(events)),
                                     filler.filler_stream(random.Random(f"{seed}:{i}:{j}")))
            lines = filler.fit(tok, stream, block_tokens)
            if j == target:
                lines.insert(rng.randint(0, len(lines)), f"{fact.name}: {fact.values[value]}\n")
            pieces += [Piece(f"## Memory note {j + 1}\n", seg), *[Piece(x, seg) for x in lines],
                       Piece("\n", seg)]
        pieces += [Piece(fr.mid, "turn_user"), Piece(fact.question + "\n", "question"),
                   Piece(TASK, "task"), Piece(fr.tail, "turn_answer"),
                   Piece(ANSWER_PREFIX + fr.answer_sep, "answer_prefix")]
        a = assemble(tok, [p for p in pieces if p.text], mutable=False)
        dec = decision_ids(tok, fact.outcomes, a.old_text)
        out.append(BlendItem(f"memory/s{seed}/{i:04d}/{fact.name}", "memory",
                             _cut(list(a.old_ids), a.segments, "block:"), dec, dec[value],
                             meta={"domain": fact.name, "target_block": target}))
    return out


def _session_of(dia_id: str) -> int | None:
    m = re.match(r"D(\d+):", dia_id)
    return int(m.group(1)) if m else None


def locomo_items(path: str, tok: Any, chat: bool, n: int, n_blocks: int, block_tokens: int,
                 seed: int) -> list[BlendItem]:
    """Up to n items, round-robin over the conversations with at least n_blocks sessions."""

    fr = frame(tok, chat)
    pools = []
    for c, conv in enumerate(locomo.load(path)):
        if len(conv.sessions) < n_blocks:
            continue
        blocks: dict[int, tuple[int, ...]] = {}
        covered: set[str] = set()
        for s in conv.sessions:
            ids: list[int] = []
            for j, t in enumerate(s.turns):
                piece = encode(tok, (s.header() if j == 0 else "") + t.render())
                if ids and len(ids) + len(piece) > block_tokens:
                    break
                ids += piece
                covered.add(t.dia_id)
            blocks[s.index] = tuple(ids)
        qs = [q for q in locomo.questions(conv, frozenset(covered))
              if len({_session_of(e) for e in q.evidence}) <= n_blocks
              and all(_session_of(e) in blocks for e in q.evidence)]
        random.Random(f"blend-locomo:{seed}:{c}").shuffle(qs)
        if qs:
            pools.append((c, conv, blocks, qs))
    out: list[BlendItem] = []
    for k in range(max((len(p[3]) for p in pools), default=0)):
        for c, conv, blocks, qs in pools:
            if len(out) >= n or k >= len(qs):
                continue
            q = qs[k]
            rng = random.Random(f"blend-locomo:{seed}:{c}:{k}")
            need = sorted({sid for e in q.evidence if (sid := _session_of(e)) is not None})
            rest = [s for s in blocks if s not in need]
            chosen = need + rng.sample(rest, n_blocks - len(need))
            rng.shuffle(chosen)
            header = f"## Conversation memory between {conv.speakers[0]} and {conv.speakers[1]}\n"
            head = encode(tok, fr.head + LOCOMO_INTRO + header)
            tail = encode(tok, fr.mid + f"Question: {q.question}\n{LOCOMO_TASK}" + fr.tail + "Answer:")
            lay = Layout(tuple(head), tuple(blocks[s] for s in chosen), tuple(tail))
            out.append(BlendItem(f"locomo/{conv.sample_id or c}/q{k:03d}", "locomo", lay,
                                 gold=str(q.answer),
                                 meta={"domain": locomo.CATEGORIES.get(q.category, str(q.category)),
                                       "sessions": chosen, "evidence_sessions": need}))
    return out
