"""Order items: the field line before or after the rule, task content or filler after both.

The distance layout moved the field after the rule *and* left only filler after it, so its sweep
cannot say which of the two decides where the conclusion is kept. Here one gated draw (domain,
values, rule text, request, demonstrations) is rendered in a 2 x 2 x S design:

    order    field_before_rule: session (field as its last line), then the rule
             field_after_rule:  the rule, then the session
    content  task:   the stretch holds the demonstrations and the request (plus filler to length)
             filler: the stretch holds neutral filler only; demonstrations and request go before
                     the field and the rule
    stretch  tokens from the end of the later of field and rule to the task line (64, 256, 1024)

so stretch_tokens = task_start - later_end, with later_end the end of whichever of the session
block and the rule line comes second. In task cells the content sits at the end of the stretch
(`place="end"`, next to the task line as in `gated`) or at its start (`place="start"`). Pieces
are tokenized one by one, so the field, values, rule, demonstrations and request are token-
identical in every cell. Cells of one stretch share their total length within a few tokens
(task cells pad the system policy with as many filler tokens as the content takes upstream in
filler cells); `equal_length` pads all cells of an item to its longest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.distance import layout_draw, layout_stream, session_field_last
from kvnotes.tasks.domains import banks
from kvnotes.tasks.gated import Draw, example_pieces, outcome_for, rule_pieces
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.templates import Suite, configured_suite
from kvnotes.tasks.tokens import Assembled, Frame, Piece, assemble, encode, frame, rendered_fields

LAYOUT = "order"
ORDERS = ("field_before_rule", "field_after_rule")
CONTENTS = ("task", "filler")
PLACES = ("end", "start")
SLACK = 12  # a stretch lands at most this many tokens below its target (filler.fit's last gap)
MAX_STRETCH = 8000  # the filler bank's tested range


@dataclass(frozen=True)
class Cell:
    """One cell of the design: field/rule order, what fills the stretch, its target length."""

    order: str
    content: str
    stretch: int

    def __post_init__(self) -> None:
        if self.order not in ORDERS or self.content not in CONTENTS:
            raise ValueError(f"cell {self.order}/{self.content}: order in {ORDERS}, content in {CONTENTS}")
        if not 1 <= self.stretch <= MAX_STRETCH:
            raise ValueError(f"stretch must be in [1, {MAX_STRETCH}] tokens, got {self.stretch}")

    @property
    def key(self) -> str:
        return f"{self.order}/{self.content}/{self.stretch}"


def check_stretches(stretches: Sequence[int]) -> list[int]:
    ss = [int(s) for s in stretches]
    if not ss or any(s != x for s, x in zip(ss, stretches, strict=True)) or len(set(ss)) != len(ss) \
            or any(not 1 <= s <= MAX_STRETCH for s in ss):
        raise ValueError(f"stretches must be distinct ints in [1, {MAX_STRETCH}], got {list(stretches)}")
    return sorted(ss)


def cells(stretches: Sequence[int]) -> list[Cell]:
    """Every cell, order-major: orders x contents x stretches."""
    return [Cell(o, c, s) for o, c, s in itertools.product(ORDERS, CONTENTS, check_stretches(stretches))]


def _content(d: Draw) -> list[Piece]:
    """Demonstrations and the request: the same pieces wherever they go."""
    req = banks()["frame"]["request"].format(request=d.domain.requests[d.request])
    return example_pieces(d) + [Piece(req + "\n", "request")]


def _session(d: Draw) -> list[Piece]:
    """The session block, field last, without the distance layout's leading blank line."""
    first, *rest = session_field_last(d)
    return [replace(first, text=first.text.lstrip("\n")), *rest]


def _join(blocks: Sequence[list[Piece]]) -> list[Piece]:
    """Non-empty blocks separated by a blank line (its own piece, in no segment)."""
    out: list[Piece] = []
    for b in (b for b in blocks if b):
        out += ([Piece("\n")] if out else []) + b
    return out


def order_pieces(suite: Suite, d: Draw, fr: Frame, cell: Cell, lines: Sequence[str],
                 before: Sequence[str], place: str = "end") -> list[Piece]:
    """The whole prompt: `lines` are the stretch's filler, `before` the system policy's."""
    f = banks()["frame"]
    system = [Piece(f["intro"].format(role=d.domain.role) + "\n\n", "intro"),
              Piece(f["policy_header"] + "\n", "policy"), *[Piece(x, "policy") for x in before],
              Piece("\n" + f["tools_header"] + "\n" + ", ".join(d.tools), "tools")]
    rule = rule_pieces(d, "field", f["rule_header"])
    pair = [_session(d), rule] if cell.order == "field_before_rule" else [rule, _session(d)]
    pad = [Piece(f["policy_header"] + "\n", "stretch"), *[Piece(x, "stretch") for x in lines]] if lines else []
    if cell.content == "filler":
        blocks = [_content(d), *pair, pad]
    else:
        blocks = [*pair, *([pad, _content(d)] if place == "end" else [_content(d), pad])]
    task = f["task_field"].format(field=d.domain.field) if suite.design.point_to_field else f["task"]
    user = [*_join(blocks), Piece(task, "task")]
    out = [Piece(fr.head, "head"), *system, Piece(fr.mid, "turn_user"), *user, Piece(fr.tail, "turn_answer")]
    if suite.design.answer_prefix or not fr.chat:
        out.append(Piece(f["answer_prefix"] + fr.answer_sep, "answer_prefix"))
    return [p for p in out if p.text or p.alt]


def later_end(a: Assembled) -> int:
    """End of whichever of the session block (field last) and the rule comes second."""
    return max(a.segments["session"][1], a.segments["rule"][1])


def stretch_of(a: Assembled) -> int:
    """Tokens between the later of field and rule and the task line."""
    return a.segments["task"][0] - later_end(a)


def _draw(suite: Suite, index: int, seed: int) -> Draw:
    return layout_draw(suite, index, seed, "order")


def _stream(suite: Suite, d: Draw, index: int, seed: int) -> Iterator[str]:
    """One filler stream per item: every cell takes its stretch lines from its start."""
    return layout_stream(suite, d, index, seed, "order")


def _render(suite: Suite, tok: Any, fr: Frame, d: Draw, index: int, seed: int, cell: Cell, place: str,
            total: int | None) -> Assembled:
    """The cell's prompt: stretch filler to its target, then (with `total`) system filler to it."""
    lines = _stream(suite, d, index, seed)
    base = stretch_of(assemble(tok, order_pieces(suite, d, fr, cell, [], [], place)))
    if cell.stretch < base - SLACK:
        what = "the demonstrations and request" if cell.content == "task" else "the separators"
        raise ValueError(f"stretch {cell.stretch} is below the {base} tokens {what} take (item {index}, "
                         f"{d.domain.name}, this tokenizer); use stretches >= {base}")
    header = len(encode(tok, banks()["frame"]["policy_header"] + "\n"))
    budget = cell.stretch - base - header - len(encode(tok, "\n"))  # and the blank line before it
    after = filler.fit(tok, lines, budget) if budget > 0 else []
    a = assemble(tok, order_pieces(suite, d, fr, cell, after, [], place))
    if total is not None and total > len(a.old_ids):
        before = filler.fit(tok, lines, total - len(a.old_ids))
        a = assemble(tok, order_pieces(suite, d, fr, cell, after, before, place))
    return a


def _item(suite: Suite, tok: Any, fr: Frame, d: Draw, index: int, seed: int, cell: Cell, place: str,
          a: Assembled) -> TaskItem:
    dom = d.domain
    le = later_end(a)
    return TaskItem(
        item_id=f"{suite.name}/s{seed}/{cell.order}/{cell.content}/S{cell.stretch}/{index:04d}/{dom.name}",
        suite=suite.name, domain=dom.name, template_id=f"{dom.name}/rule{d.rule}/req{d.request}", seed=seed,
        variant=suite.variant, field_name=dom.field, old_value=dom.values[d.value],
        new_value=dom.values[1 - d.value], correct_old=outcome_for(d, d.value, 0),
        correct_new=outcome_for(d, 1 - d.value, 0),
        **rendered_fields(tok, a, dom.outcomes, fr.chat),
        meta={"layout": LAYOUT, "order": cell.order, "content": cell.content, "stretch": cell.stretch,
              "stretch_tokens": stretch_of(a), "later_end": le, "distance_tokens": len(a.old_ids) - le,
              "index": index, "place": place, "fewshot": suite.design.fewshot},
    )


def build_order_items(suite: Suite, tok: Any, fr: Frame, index: int, stretches: Sequence[int], seed: int,
                      place: str = "end", equal_length: bool = False) -> list[TaskItem]:
    """Every cell of item `index` (order x content x stretch, cells() order): one draw, so field,
    values, rule, demonstrations and request are token-identical across cells; cells of one stretch
    (every cell with `equal_length`) are padded in the system policy to the longest of them."""
    if place not in PLACES:
        raise ValueError(f"place {place!r}; valid: {PLACES}")
    d = _draw(suite, index, seed)
    cs = cells(stretches)
    natural = {c: _render(suite, tok, fr, d, index, seed, c, place, None) for c in cs}
    out = []
    for c in cs:
        group = [g for g in cs if equal_length or g.stretch == c.stretch]
        total = max(len(natural[g].old_ids) for g in group)
        a = natural[c] if len(natural[c].old_ids) == total else _render(suite, tok, fr, d, index, seed, c,
                                                                          place, total)
        out.append(_item(suite, tok, fr, d, index, seed, c, place, a))
    return out


def build_order_suite(
    suite: str,
    tokenizer: Any,
    chat: bool = True,
    stretches: Sequence[int] = (64, 256, 1024),
    n_items: int | None = None,
    seed: int | None = None,
    template_dirs: Sequence[str | Path] = (),
    domains: Sequence[str] | None = None,
    design: Mapping[str, Any] | None = None,
    place: str = "end",
    equal_length: bool = False,
) -> list[TaskItem]:
    """Items 0..n_items-1 of a gated field suite, each in every cell (index-major order).

    `domains` and `design` subset and override as in `build_suite` (design.rule_position has no
    effect: the cell fixes it). A stretch below what an item's task content needs raises here.
    """
    s = configured_suite(suite, template_dirs, domains, design)
    n = s.n_items if n_items is None else n_items
    if n < 1:
        raise ValueError(f"n_items must be >= 1, got {n}")
    sd = s.seed if seed is None else seed
    fr = frame(tokenizer, chat)
    return [it for i in range(n) for it in build_order_items(s, tokenizer, fr, i, stretches, sd, place,
                                                             equal_length)]
