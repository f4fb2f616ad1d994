"""Task suites: token-aligned old/new prompts with a gated decision, drawn from templates by seed.

`build_suite(name, tokenizer, chat, n_items, length, seed)` renders a suite's items;
`score_items` reads the decision logits; `validate` marks which items a model conditions on
(usable for recovery: |score_new - score_old| >= margin; for P(correct): also argmax-correct
under both values). Skills, agent scenarios and user memory feed the composition experiments.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvnotes.tasks.domains import Domain, domain_names
from kvnotes.tasks.gated import build_item, skeleton_length
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.memory import build_memory_item, memory_skeleton_length
from kvnotes.tasks.scoring import ItemScore, score_items
from kvnotes.tasks.skills import build_skill_item, skill_skeleton_length
from kvnotes.tasks.templates import (
    Design,
    Suite,
    UnknownSuiteError,
    configured_suite,
    load_suite,
    suite_names,
)
from kvnotes.tasks.tokens import AlignmentError, DecisionTokenError, frame
from kvnotes.tasks.validate import Selection, select_usable, summarize, validate

log = logging.getLogger(__name__)

__all__ = [
    "AlignmentError",
    "DecisionTokenError",
    "Design",
    "Domain",
    "ItemScore",
    "Selection",
    "Suite",
    "TaskItem",
    "UnknownSuiteError",
    "build_suite",
    "required_length",
    "domain_names",
    "load_suite",
    "score_items",
    "select_usable",
    "suite_names",
    "summarize",
    "validate",
]


def build_suite(
    suite: str,
    tokenizer: Any,
    chat: bool = True,
    n_items: int | None = None,
    length: int | None = None,
    seed: int | None = None,
    domains: Sequence[str] | None = None,
    design: Mapping[str, Any] | None = None,
    template_dirs: Sequence[str | Path] = (),
) -> list[TaskItem]:
    """Items of a suite rendered for `tokenizer`; None takes the suite file's default.

    `chat` applies the tokenizer's chat template when it has one (base models get completion
    text); `domains` keeps a subset; `design` overrides the suite's prompt-design fields.
    """
    s = configured_suite(suite, template_dirs, domains, design)
    n = s.n_items if n_items is None else n_items
    L = s.length if length is None else length
    sd = s.seed if seed is None else seed
    if n < 1:
        raise ValueError(f"n_items must be >= 1, got {n}")
    fr = frame(tokenizer, chat)
    if s.kind == "gated":
        items = [build_item(s, tokenizer, fr, i, L, sd) for i in range(n)]
    elif s.kind == "skills":
        items = [build_skill_item(s, tokenizer, fr, i, L, sd) for i in range(n)]
    elif s.kind == "memory":
        items = [build_memory_item(s, tokenizer, fr, i, L, sd) for i in range(n)]
    else:
        raise ValueError(
            f"suite {suite!r} is of kind {s.kind!r}: use kvnotes.tasks.agents.build_scenarios"
        )
    log.info("built %d %s items (length %d, seed %d, chat=%s)", n, suite, L, sd, fr.chat)
    return items


SKELETONS = {"gated": skeleton_length, "skills": skill_skeleton_length, "memory": memory_skeleton_length}


def required_length(
    suite: str,
    tokenizer: Any,
    chat: bool = True,
    n_items: int | None = None,
    seed: int | None = None,
    domains: Sequence[str] | None = None,
    design: Mapping[str, Any] | None = None,
    template_dirs: Sequence[str | Path] = (),
) -> tuple[int, int]:
    """(tokens, item index) of the suite's longest item without filler: the least `length`
    `build_suite` takes with these arguments, found by tokenizing each item's skeleton (no
    filler fitted, no model). Arguments as `build_suite`'s."""
    s = configured_suite(suite, template_dirs, domains, design)
    n = s.n_items if n_items is None else n_items
    if n < 1:
        raise ValueError(f"n_items must be >= 1, got {n}")
    if s.kind not in SKELETONS:
        raise ValueError(f"suite {suite!r} is of kind {s.kind!r}: use kvnotes.tasks.agents.build_scenarios")
    fr = frame(tokenizer, chat)
    sd = s.seed if seed is None else seed
    need = [SKELETONS[s.kind](s, tokenizer, fr, i, sd) for i in range(n)]
    longest = max(range(n), key=need.__getitem__)
    return need[longest], longest
