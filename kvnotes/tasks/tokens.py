"""Token-aligned rendering: a prompt is a list of text pieces tokenized one by one.

Concatenating per-piece token ids makes lengths additive (so filler can hit a token budget
exactly) and pins the mutable piece to its own token span: old and new values are tokenized
alone and the shorter is padded with a neutral token (a space), so the two prompts have the same
length and differ only inside that span. The decision is read at the last position from the
first token of each outcome word, resolved per tokenizer; two outcomes sharing a first token
are refused, since their logits could not be told apart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvnotes.errors import KvnotesError

log = logging.getLogger(__name__)
SENTINEL_SYSTEM = "\x00KVNOTES_SYSTEM\x00"
SENTINEL_USER = "\x00KVNOTES_USER\x00"


class DecisionTokenError(KvnotesError, ValueError):
    """Two outcomes share their first token under a tokenizer; the message names them."""


class AlignmentError(KvnotesError, ValueError):
    """Old and new ids are not the same length or differ outside the field span."""


@dataclass(frozen=True)
class Piece:
    """A run of prompt text; `alt` marks the one mutable piece (text = old, alt = new)."""

    text: str
    segment: str | None = None
    alt: str | None = None
    cf: str | None = None  # content-free alternative of the mutable piece (calibration)


@dataclass(frozen=True)
class Assembled:
    old_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    old_text: str
    new_text: str
    span: tuple[int, int]
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)
    cf_ids: tuple[int, ...] | None = None  # the content-free prompt, aligned like new_ids


@dataclass(frozen=True)
class Frame:
    """Where system and user text go: chat-template wrappers, or plain completion text."""

    chat: bool
    head: str  # before the system text (chat header, or BOS for a base model)
    mid: str  # between system and user text
    tail: str  # after the user text, through the assistant header
    system_role: bool = True  # False: the template has no system role (merged into the user turn)
    answer_sep: str = ""  # appended to an answer prefix when a space is its own token


def encode(tok: Any, text: str) -> list[int]:
    """Ids of `text` alone, without BOS/EOS (special-token strings are still recognised)."""
    if not text:
        return []
    return list(tok(text, add_special_tokens=False)["input_ids"])


def bos_text(tok: Any) -> str:
    """The BOS string when the tokenizer prepends one by default (gemma), else ''."""
    bos = getattr(tok, "bos_token_id", None)
    ids = tok("a")["input_ids"]
    return str(tok.bos_token) if bos is not None and ids and ids[0] == bos else ""


def pad_id(tok: Any) -> int:
    """A neutral filler token for padding the shorter value: a single space, else '.'."""
    for s in (" ", "."):
        ids = encode(tok, s)
        if len(ids) == 1:
            return ids[0]
    raise ValueError(f"{type(tok).__name__}: no single-token space or '.' to pad with")


def has_chat(tok: Any) -> bool:
    return bool(getattr(tok, "chat_template", None))


def space_is_separate(tok: Any) -> bool:
    """True when a leading space is its own token (character-level tokenizers): then every
    outcome would start with the same space token, so the prompt ends with the space instead."""
    sp, word = encode(tok, " "), encode(tok, " a")
    return len(sp) == 1 and len(word) > 1 and word[0] == sp[0]


def frame(tok: Any, chat: bool) -> Frame:
    """Split the chat template around sentinel messages (or build a completion frame)."""
    sep = " " if space_is_separate(tok) else ""
    if not (chat and has_chat(tok)):
        return Frame(False, bos_text(tok), "\n\n", "\n", answer_sep=sep)
    msgs = [{"role": "system", "content": SENTINEL_SYSTEM}, {"role": "user", "content": SENTINEL_USER}]
    try:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        system_role = SENTINEL_SYSTEM in text
    except Exception:  # templates that refuse a system role (gemma-2-it)
        system_role = False
    if not system_role:
        msgs = [{"role": "user", "content": SENTINEL_SYSTEM + SENTINEL_USER}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, rest = text.split(SENTINEL_SYSTEM)
    mid, tail = rest.split(SENTINEL_USER)
    if not system_role:
        mid = "\n\n"
    return Frame(True, head, mid, tail, system_role, sep)


def _pad(ids: list[int], n: int, pad: int) -> list[int]:
    return ids + [pad] * (n - len(ids))


def assemble(tok: Any, pieces: Sequence[Piece], mutable: bool = True) -> Assembled:
    """Tokenize piece by piece; exactly one piece has `alt` (old = text, new = alt).

    `mutable=False` renders a prompt without a mutable piece (old == new, span (0, 0)).
    """
    n_mut = sum(p.alt is not None for p in pieces)
    if n_mut != int(mutable):
        raise ValueError(f"{int(mutable)} mutable piece(s) needed, got {n_mut}")
    pad = pad_id(tok)
    pad_str = tok.decode([pad])
    old: list[int] = []
    new: list[int] = []
    cf: list[int] = []
    old_text: list[str] = []
    new_text: list[str] = []
    segments: dict[str, tuple[int, int]] = {}
    span = (0, 0)
    for p in pieces:
        start = len(old)
        if p.alt is None:
            ids = encode(tok, p.text)
            old += ids
            new += ids
            cf += ids
            old_text.append(p.text)
            new_text.append(p.text)
        else:
            a, b = encode(tok, p.text), encode(tok, p.alt)
            c = encode(tok, p.cf) if p.cf is not None else []
            n = max(len(a), len(b), len(c))
            old += _pad(a, n, pad)
            new += _pad(b, n, pad)
            cf += _pad(c, n, pad)
            old_text.append(p.text + pad_str * (n - len(a)))
            new_text.append(p.alt + pad_str * (n - len(b)))
            span = (start, start + n)
        if p.segment:
            s, e = segments.get(p.segment, (start, len(old)))
            segments[p.segment] = (min(s, start), len(old))
    has_cf = any(p.cf is not None for p in pieces)
    out = Assembled(tuple(old), tuple(new), "".join(old_text), "".join(new_text), span, segments,
                    tuple(cf) if has_cf else None)
    if mutable:
        check_alignment(out.old_ids, out.new_ids, span)
    if out.cf_ids is not None:
        check_alignment(out.old_ids, out.cf_ids, span)
    return out


def check_alignment(old: Sequence[int], new: Sequence[int], span: tuple[int, int]) -> None:
    """Same length, identical outside `span`, and different inside it."""
    if len(old) != len(new):
        raise AlignmentError(f"old has {len(old)} tokens, new {len(new)}")
    s, e = span
    if not 0 <= s < e <= len(old):
        raise AlignmentError(f"span {span} outside a prompt of {len(old)} tokens")
    if list(old[:s]) != list(new[:s]) or list(old[e:]) != list(new[e:]):
        raise AlignmentError(f"old and new differ outside the field span {span}")
    if list(old[s:e]) == list(new[s:e]):
        raise AlignmentError(f"old and new are identical inside the field span {span}")


def decision_ids(tok: Any, outcomes: Sequence[str], prompt_text: str) -> tuple[int, ...]:
    """First token of each outcome as it would follow `prompt_text`; refuses shared first tokens."""
    sep = "" if not prompt_text or prompt_text[-1].isspace() else " "
    firsts = []
    for o in outcomes:
        ids = encode(tok, sep + o)
        if not ids:
            raise DecisionTokenError(f"outcome {o!r} encodes to no tokens")
        firsts.append(ids[0])
        warn_common_prefix(tok, o, ids[0], len(ids))
    for i in range(len(outcomes)):
        for j in range(i + 1, len(outcomes)):
            if firsts[i] == firsts[j]:
                raise DecisionTokenError(
                    f"outcomes {outcomes[i]!r} and {outcomes[j]!r} share their first token "
                    f"{tok.decode([firsts[i]])!r} (id {firsts[i]}) under {type(tok).__name__} "
                    f"{getattr(tok, 'name_or_path', '')}; choose outcome words whose first tokens differ"
                )
    return tuple(firsts)


COMMON_PREFIX = 200  # a first piece that begins this many other vocabulary tokens is a prefix
_prefix_checked: set[tuple[str, int, str]] = set()  # (name, id(tokenizer), outcome)


def prefix_extensions(tok: Any, token_id: int) -> int:
    """How many other vocabulary tokens begin with token `token_id` (' re' -> ' return', ...)."""
    raw = tok.convert_ids_to_tokens(token_id)
    return sum(1 for v in tok.get_vocab() if v != raw and v.startswith(raw))


def warn_common_prefix(tok: Any, outcome: str, first: int, n_pieces: int) -> None:
    """Log a warning (once per tokenizer and outcome) when a multi-token outcome is read from a
    first piece that is a common prefix: " rebook" is scored on ' re', whose logit also rises
    for ' return', ' read', ... so the decision measures more than the outcome word."""
    if n_pieces < 2 or not (hasattr(tok, "get_vocab") and hasattr(tok, "convert_ids_to_tokens")):
        return
    key = (str(getattr(tok, "name_or_path", "")), id(tok), outcome)
    if key in _prefix_checked:
        return
    _prefix_checked.add(key)
    n = prefix_extensions(tok, first)
    if n >= COMMON_PREFIX:
        log.warning(
            "outcome %r is scored on its first token %r, a prefix of %d other tokens of %s; "
            "its logit also rises for unrelated words: prefer an outcome whose first token is "
            "a whole word", outcome, tok.decode([first]), n, key[0] or type(tok).__name__,
        )


_PUNCT = set(".,:;!?-()[]{}#*|/\\'\"`>_=")


def is_aggregator(token_text: str) -> bool:
    """Newlines, punctuation and section marks: where the paper finds the memoized notes."""
    s = token_text.strip()
    return "\n" in token_text or s == "" or all(c in _PUNCT for c in s)


def aggregator_positions(tok: Any, ids: Sequence[int], start: int) -> tuple[int, ...]:
    """Positions >= start whose token is a newline, punctuation or a special token."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    texts: dict[int, str] = {}
    out = []
    for p in range(start, len(ids)):
        i = ids[p]
        if i not in texts:
            texts[i] = tok.decode([i])
        if i in special or is_aggregator(texts[i]):
            out.append(p)
    return tuple(out)


def rendered_fields(tok: Any, a: Assembled, outcomes: Sequence[str], chat: bool) -> dict[str, Any]:
    """The TaskItem fields every suite derives the same way from an assembled prompt pair."""
    return {
        "old_text": a.old_text,
        "new_text": a.new_text,
        "old_ids": a.old_ids,
        "new_ids": a.new_ids,
        "field_span": a.span,
        "aggregators": aggregator_positions(tok, a.old_ids, a.span[1]),
        "outcomes": tuple(outcomes),
        "decision_ids": decision_ids(tok, outcomes, a.old_text),
        "chat": chat,
        "segments": a.segments,
        "cf_ids": a.cf_ids,
    }
