"""LoCoMo (long conversational memory) in its official file format, as a user-memory source.

`locomo10.json` is a list of samples: `conversation` holds `speaker_a`, `speaker_b` and
`session_<n>` turn lists (`speaker`, `dia_id` like "D3:7", `text`, optional `blip_caption` of a
shared image) with `session_<n>_date_time`; `qa` holds questions with `answer`, `evidence`
(dia ids) and `category` (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial,
which has no answer: the paper's 1,540 answerable questions are categories 1-4). A conversation
renders as a memory text, optionally cut to a token budget at a turn boundary; a question is
kept only when all its evidence lies in what was rendered. Answers are scored by LoCoMo's token
F1 on normalised text. The file is read from a path given by the caller; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.errors import KvnotesError

ANSWERABLE = (1, 2, 3, 4)
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


class LocomoFormatError(KvnotesError, ValueError):
    """The file is not in the LoCoMo format; the message says what is missing."""


@dataclass(frozen=True)
class Turn:
    session: int
    dia_id: str
    speaker: str
    text: str

    def render(self) -> str:
        return f"{self.speaker}: {self.text}\n"


@dataclass(frozen=True)
class Session:
    index: int
    date_time: str
    turns: tuple[Turn, ...]

    def header(self) -> str:
        when = f" ({self.date_time})" if self.date_time else ""
        return f"\n# Session {self.index}{when}\n"


@dataclass(frozen=True)
class QA:
    question: str
    answer: str | None  # None for adversarial (category 5) questions
    evidence: tuple[str, ...]
    category: int

    @property
    def answerable(self) -> bool:
        return self.category in ANSWERABLE and self.answer is not None


@dataclass(frozen=True)
class Conversation:
    sample_id: str
    speakers: tuple[str, str]
    sessions: tuple[Session, ...]
    qa: tuple[QA, ...]

    @property
    def n_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def _turn_text(t: dict[str, Any]) -> str:
    text = str(t.get("text", "")).strip()
    caption = t.get("blip_caption")
    if caption:
        text = f"{text} [shares a photo of {caption}]".strip()
    return text


def parse_sample(raw: dict[str, Any]) -> Conversation:
    """One LoCoMo sample (a dict of the official file) as a `Conversation`."""
    for key in ("conversation", "qa"):
        if key not in raw:
            raise LocomoFormatError(f"a LoCoMo sample needs {key!r}; keys: {sorted(raw)}")
    conv = raw["conversation"]
    numbers = sorted(int(m.group(1)) for k in conv if (m := re.fullmatch(r"session_(\d+)", k)))
    if not numbers:
        raise LocomoFormatError("the conversation has no session_<n> turn lists")
    sessions = []
    for n in numbers:
        turns = []
        for t in conv[f"session_{n}"]:
            if "dia_id" not in t or "speaker" not in t:
                raise LocomoFormatError(f"session_{n}: a turn needs 'speaker' and 'dia_id': {t}")
            turns.append(Turn(n, str(t["dia_id"]), str(t["speaker"]), _turn_text(t)))
        sessions.append(Session(n, str(conv.get(f"session_{n}_date_time", "")), tuple(turns)))
    qa = tuple(
        QA(str(q["question"]), None if q.get("answer") is None else str(q["answer"]),
           tuple(str(e) for e in q.get("evidence", ()) or ()), int(q.get("category", 0)))
        for q in raw["qa"]
    )
    speakers = (str(conv.get("speaker_a", "A")), str(conv.get("speaker_b", "B")))
    return Conversation(str(raw.get("sample_id", "")), speakers, tuple(sessions), qa)


def load(path: str | os.PathLike[str]) -> list[Conversation]:
    """Every sample of a LoCoMo file (`locomo10.json` or a file of the same format)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise LocomoFormatError(f"{path}: expected a list of samples, got {type(data).__name__}")
    return [parse_sample(s) for s in data]


@dataclass(frozen=True)
class Memory:
    """A rendered conversation: text pieces (a header, then one per turn) and their dia ids."""

    pieces: tuple[str, ...]
    dia_ids: frozenset[str]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def render_memory(conv: Conversation, tokenizer: Any = None, max_tokens: int | None = None) -> Memory:
    """The conversation as memory pieces, cut at the last whole turn within `max_tokens` tokens.

    Token counts add up piece by piece (the header and each turn, with its session header when it
    opens one, tokenized on its own), the same way an experiment encodes the pieces.
    """
    header = f"## Conversation memory between {conv.speakers[0]} and {conv.speakers[1]}\n"
    pieces: list[str] = [header]
    ids: set[str] = set()
    used = _count(tokenizer, header) if max_tokens is not None else 0
    for s in conv.sessions:
        for j, t in enumerate(s.turns):
            text = (s.header() if j == 0 else "") + t.render()
            n = _count(tokenizer, text) if max_tokens is not None else 0
            if max_tokens is not None and used + n > max_tokens:
                return Memory(tuple(pieces), frozenset(ids))
            pieces.append(text)
            ids.add(t.dia_id)
            used += n
    return Memory(tuple(pieces), frozenset(ids))


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:
        raise ValueError("max_tokens needs a tokenizer to count with")
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def questions(
    conv: Conversation, covered: frozenset[str] | None = None, categories: Sequence[int] = ANSWERABLE
) -> list[QA]:
    """Answerable questions of `categories` whose evidence lies entirely in `covered`."""
    out = []
    for q in conv.qa:
        if q.category not in categories or q.answer is None:
            continue
        if covered is not None and (not q.evidence or not set(q.evidence) <= covered):
            continue
        out.append(q)
    return out


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (LoCoMo / SQuAD normalisation)."""
    text = str(text).lower().replace(",", "")
    text = "".join(c for c in text if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def f1(prediction: str, gold: str) -> float:
    """Token F1 between a predicted and a gold answer after `normalize`."""
    p, g = normalize(prediction).split(), normalize(gold).split()
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if not p or not g or same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)
