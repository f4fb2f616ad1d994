"""Prompts of the serving benchmark (experiment `serving`): the ways a state change reaches a
served model, at text level (the server tokenizes), and the decision read from its answer.

The live context is a gated task item's `old_text`. A request sets the gating field to v
(new or old) and reaches the model as

* edit: the prompt re-rendered with the state in place and a fresh request id in the session
  block, so every request is a new state and every block from the session block on misses;
* edit_field: the prompt re-rendered with only the field changed (the item's own text, no
  request id), so once both values have been sent the prefix cache holds both prompts;
* erratum: the live context byte for byte, then `[STATE UPDATE] <field> has changed to v; ...`
  before the request line, so every full block before it hits;
* hoist: the field's line moved to just before the request (the prefix without it is shared).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvnotes.edit.strategies import erratum_text
from kvnotes.tasks.item import TaskItem

VARIANTS = ("edit", "edit_field", "erratum", "hoist")
VALUES = ("new", "old")
REQUEST = "Request:"  # the request line of the task frame (kvnotes/tasks/templates/_banks.yaml)


def set_line(text: str, key: str, value: str) -> str:
    """`text` with the value of its first `key: ...` line replaced (the line must exist)."""
    m = re.search(rf"(?m)^{re.escape(key)}:[^\n]*", text)
    if m is None:
        raise ValueError(f"no line '{key}:' in the prompt")
    return text[: m.start()] + f"{key}: {value}" + text[m.end():]


def drop_line(text: str, key: str) -> str:
    m = re.search(rf"(?m)^{re.escape(key)}:[^\n]*\n", text)
    if m is None:
        raise ValueError(f"no line '{key}:' in the prompt")
    return text[: m.start()] + text[m.end():]


def request_at(text: str) -> int:
    """Character offset of the request line (where the erratum goes, as in kvnotes.edit.strategies)."""
    at = text.rfind("\n" + REQUEST)
    if at < 0:
        raise ValueError(f"no '{REQUEST}' line in the prompt")
    return at + 1


def with_request(text: str, before: str, rid: str) -> str:
    """`before` inserted before the request line, which is tagged with the request id."""
    at = request_at(text)
    return text[:at] + before + f"Request ({rid}):" + text[at + len(REQUEST):]


@dataclass(frozen=True)
class Prompts:
    """The ways of sending request (value, id) against one live context `item.old_text`."""

    item: TaskItem
    wording: str = "explicit"

    def value(self, which: str) -> str:
        return (self.item.new_value if which == "new" else self.item.old_value).strip()

    def edit(self, which: str, rid: str) -> str:
        base = self.item.new_text if which == "new" else self.item.old_text
        return with_request(set_line(base, "request_id", rid), "", rid)

    def edit_field(self, which: str, rid: str) -> str:
        """The item's own prompt for this value: `rid` is not used (no per-request state)."""
        return self.item.new_text if which == "new" else self.item.old_text

    def erratum(self, which: str, rid: str) -> str:
        item = dataclasses.replace(self.item, new_value=self.value(which))
        return with_request(self.item.old_text, erratum_text(item, self.wording), rid)

    def hoist(self, which: str, rid: str) -> str:
        f = self.item.field_name
        return with_request(drop_line(self.item.old_text, f), f"{f}: {self.value(which)}\n", rid)

    def build(self, variant: str, which: str, rid: str) -> str:
        if variant not in VARIANTS or which not in VALUES:
            raise ValueError(f"variant {variant!r} / value {which!r}; valid: {VARIANTS} / {VALUES}")
        text: str = getattr(self, variant)(which, rid)
        return text

    def warm(self, variant: str) -> str:
        """What the live session last sent: its prefix is what a running server has cached."""
        if variant == "hoist":
            f = self.item.field_name
            text = drop_line(self.item.old_text, f)
            at = request_at(text)
            return text[:at] + f"{f}: {self.value('old')}\n" + text[at:]
        return self.item.old_text

    def expected(self, which: str) -> str:
        """The decision the field value `which` requires."""
        return self.item.correct_new if which == "new" else self.item.correct_old


def decision_of(text: str, outcomes: Sequence[str]) -> str:
    """The outcome named by the first generated word (a truncated name counts), else the word."""
    m = re.search(r"[A-Za-z][A-Za-z0-9_\-]*", text)
    word = m.group(0) if m else ""
    hits = [o for o in outcomes if word and (o.startswith(word) or word.startswith(o))]
    return hits[0] if len(hits) == 1 else word


def which_of(i: int) -> str:
    """The field value of request i of a phase: new, old, new, ... (the live context holds old)."""
    return "new" if i % 2 == 0 else "old"


def request_id(phase: int, i: int) -> str:
    """6 digits: never equal to a task item's own 5-digit request id."""
    return f"RQ-{phase:02d}{i:04d}"
