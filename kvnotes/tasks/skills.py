"""Skill items for composition: several skill blocks, then a question one skill's rule decides.

A skill block is a binding rule among neutral guidelines (and optional worked examples). Every
block is tokenized on its own, so its ids are the same wherever it is placed: a composition
experiment can prefill `old_ids[s:e]` for the segment `skill:<name>` alone and splice it. The
mutable value sits in the question (after the blocks), so old and new flip the correct tool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.domains import bank
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.templates import Suite
from kvnotes.tasks.tokens import Frame, Piece, assemble, rendered_fields

INTRO = "You are an operations agent. Apply the skill that matches the request."
TASK = "Reply with the name of the tool only."
ANSWER_PREFIX = "Next action:"
CONTENT_FREE = " N/A"


@dataclass(frozen=True)
class Skill:
    name: str
    title: str
    values: tuple[str, str]
    outcomes: tuple[str, str]
    rule: str
    question: str
    guidelines: tuple[str, ...]

    def __post_init__(self) -> None:
        if " {value}" not in self.question:
            raise ValueError(f"skill {self.name!r}: the question needs ' {{value}}'")


def skills() -> dict[str, Skill]:
    out = {}
    for name, d in bank("skills").items():
        out[name] = Skill(name, d["title"], tuple(d["values"]), tuple(d["outcomes"]),
                          d["rule"], d["question"], tuple(d.get("guidelines", ())))
    return out


def skill_names() -> list[str]:
    return sorted(skills())


def block_pieces(skill: Skill, fill: list[str], fewshot: int, rng: random.Random) -> list[Piece]:
    """`### Skill: <title>`, half the filler, the rule, examples, the other half."""
    seg = f"skill:{skill.name}"
    rule = skill.rule.format(o0=skill.outcomes[0], o1=skill.outcomes[1])
    half = len(fill) // 2
    out = [Piece(f"### Skill: {skill.title}\n", seg)]
    out += [Piece(line, seg) for line in fill[:half]]
    out.append(Piece(f"- Rule: {rule}\n", seg))
    demos = [0, 1] * (fewshot // 2)
    rng.shuffle(demos)
    for v in demos:
        q = skill.question.format(value=skill.values[v])
        out.append(Piece(f"- Example: {q} -> {skill.outcomes[v]}\n", seg))
    out += [Piece(line, seg) for line in fill[half:]]
    return out + [Piece("\n", seg)]


def question_pieces(skill: Skill, value: int) -> list[Piece]:
    before, after = skill.question.split(" {value}")
    return [
        Piece(before, "question"),
        Piece(" " + skill.values[value], "question", " " + skill.values[1 - value], CONTENT_FREE),
        Piece(after + "\n", "question"),
        Piece(TASK, "task"),
    ]


def _pieces(
    chosen: list[Skill], fills: list[list[str]], target: Skill, value: int, fr: Frame,
    fewshot: int, rng: random.Random,
) -> list[Piece]:
    out = [Piece(fr.head, "head"), Piece(INTRO + "\n\n", "intro")]
    for s, fill in zip(chosen, fills, strict=True):
        out += block_pieces(s, fill, fewshot, random.Random(f"{rng.random()}"))
    out += [Piece(fr.mid, "turn_user"), *question_pieces(target, value), Piece(fr.tail, "turn_answer"),
            Piece(ANSWER_PREFIX + fr.answer_sep, "answer_prefix")]
    return [p for p in out if p.text]


@dataclass(frozen=True)
class _Plan:
    """What item `index` holds before any filler: its skills in order, the target and its value."""

    chosen: list[Skill]
    target: Skill
    value: int
    layout_seed: float


def _plan(suite: Suite, index: int, seed: int) -> _Plan:
    bank_ = skills()
    names = list(suite.options.get("skills") or sorted(bank_))
    n_skills = int(suite.options.get("n_skills", 3))
    rng = random.Random(f"{suite.name}:{seed}:{index}")
    target = bank_[names[index % len(names)]]
    value = (index // len(names)) % 2
    others = rng.sample([n for n in names if n != target.name], n_skills - 1)
    chosen = [target] + [bank_[n] for n in others]
    rng.shuffle(chosen)
    return _Plan(chosen, target, value, rng.random())


def _skeleton(suite: Suite, tok: Any, fr: Frame, plan: _Plan) -> int:
    empty: list[list[str]] = [[] for _ in plan.chosen]
    return len(assemble(tok, _pieces(plan.chosen, empty, plan.target, plan.value, fr,
                                     suite.design.fewshot, random.Random(plan.layout_seed))).old_ids)


def skill_skeleton_length(suite: Suite, tok: Any, fr: Frame, index: int, seed: int) -> int:
    """Tokens of item `index` without filler: the least `length` `build_skill_item` renders it at."""
    return _skeleton(suite, tok, fr, _plan(suite, index, seed))


def build_skill_item(suite: Suite, tok: Any, fr: Frame, index: int, length: int, seed: int) -> TaskItem:
    """Item `index`: `options.n_skills` blocks (default 3), target skill round-robin."""
    plan = _plan(suite, index, seed)
    chosen, target, value, layout_seed = plan.chosen, plan.target, plan.value, plan.layout_seed
    fewshot = suite.design.fewshot
    base = _skeleton(suite, tok, fr, plan)
    if length < base:
        raise ValueError(f"length {length} is below the {base} tokens skill item {index} needs")
    share = (length - base) // len(chosen)
    fills = []
    for s in chosen:
        stream = filler.filler_stream(random.Random(f"{suite.name}:{seed}:{index}:{s.name}"), s.guidelines)
        fills.append(filler.fit(tok, stream, share))
    a = assemble(tok, _pieces(chosen, fills, target, value, fr, fewshot, random.Random(layout_seed)))
    return TaskItem(
        item_id=f"{suite.name}/s{seed}/L{length}/{index:04d}/{target.name}",
        suite=suite.name,
        domain=target.name,
        template_id=f"{target.name}/" + "+".join(s.name for s in chosen),
        seed=seed,
        variant="field",
        field_name="question_value",
        old_value=target.values[value],
        new_value=target.values[1 - value],
        correct_old=target.outcomes[value],
        correct_new=target.outcomes[1 - value],
        **rendered_fields(tok, a, target.outcomes, fr.chat),
        meta={"skills": [s.name for s in chosen], "target_skill": target.name, "length": length},
    )
