"""The prompts of the composition timing runs (the compose_scaling experiment and
benchmarks.engine): a skill block of an exact token length, and the system prefix and question
around it."""

from __future__ import annotations

import random
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.skills import skills
from kvnotes.tasks.tokens import encode, frame

INTRO = "You are an operations agent. Apply the skill that matches the request.\n\n"
TASK = "Reply with the name of the tool only."
ANSWER_PREFIX = "Next action:"


def skill_ids(tok: Any, skill: str, length: int, seed: int) -> list[int]:
    """Exactly `length` ids: the skill's header and rule amid its guidelines and filler lines."""

    s = skills()[skill]
    rule = s.rule.format(o0=s.outcomes[0], o1=s.outcomes[1])
    head, rule_ids = encode(tok, f"### Skill: {s.title}\n"), encode(tok, f"- Rule: {rule}\n")
    ids = list(head)
    k = 0
    while len(ids) < length:  # filler lines from ever new seeds until the budget is met
        stream = filler.filler_stream(random.Random(f"{skill}:{seed}:{k}"), s.guidelines)
        lines = filler.fit(tok, stream, length)
        if k == 0:
            lines.insert(len(lines) // 8, f"- Rule: {rule}\n")
        for line in lines:
            ids += rule_ids if line.startswith("- Rule:") else encode(tok, line)
        k += 1
    return ids[:length]


def question_ids(tok: Any, skill: str, chat: bool) -> tuple[list[int], list[int]]:
    """(system prefix ids, question ids) around the skill, with the chat frame when there is one."""

    fr = frame(tok, chat)
    s = skills()[skill]
    q = s.question.format(value=s.values[1])
    return encode(tok, fr.head + INTRO), encode(tok, fr.mid + q + "\n" + TASK + fr.tail + ANSWER_PREFIX)
