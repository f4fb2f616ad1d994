"""Distance items: a gated item whose field sits a chosen number of tokens before the decision.

In the `gated` layout the field is near the top of the prompt and everything after it (the rest
of the session, the policy filler, tools, rule, demonstrations, request and task line) lies
between it and the decision: its distance is about `length` - 40 and never below the ~160-180
tokens that follow it without filler. The distance layout moves the session block to the end of
the user turn, after the rule, demonstrations and request, with the field as its last line, so
only neutral filler lines (a second policy block) and the closing task line follow it:

    distance = n_tokens - field_end   (from the last field token to the decision token)

runs from the closing's own length (26-33 tokens, by tokenizer and domain) up; a target up to
SLACK tokens below the closing is rendered with no filler after the field (the filler fit itself
lands up to ~9 tokens short of a target, so every distance is "about" its target and the records
carry the actual one). The filler that does not go after the
field goes into the policy block before it, so an item keeps its draws (domain, values, rule,
request, demonstrations) and its total length at every distance; only the field moves. The
`gated` builder is untouched: existing suites render byte-identically.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.domains import banks
from kvnotes.tasks.gated import Draw, draw, example_pieces, outcome_for, rule_pieces
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.templates import Suite, configured_suite
from kvnotes.tasks.tokens import Frame, Piece, assemble, encode, frame, rendered_fields

LAYOUT = "distance"
SLACK = 4  # a target at most this many tokens below the closing is met by the closing alone


def session_field_last(d: Draw) -> list[Piece]:
    """The session block with the gating field as its last line (controls stay constant)."""
    dom = d.domain
    f = banks()["frame"]
    out = [Piece("\n" + f["session_header"] + "\n", "session")]
    out += [Piece(f"{k}: {v}\n", "session") for k, v in d.context.items()]
    old_c = d.controls[0]
    out += [Piece(f"{k}: {old_c[k]}\n", "session") for k in ("request_id", "current_time")]
    value, alt = " " + dom.values[d.value], " " + dom.values[1 - d.value]
    cf = " " + f["content_free"]
    return out + [Piece(f"{dom.field}:", "session"), Piece(value, "session", alt, cf),
                  Piece("\n", "session")]


def after_header() -> str:
    return "\n" + banks()["frame"]["policy_header"] + "\n"


def distance_pieces(suite: Suite, d: Draw, fr: Frame, before: Sequence[str],
                    after: Sequence[str]) -> list[Piece]:
    """The whole prompt: `before` lines in the policy above, `after` lines between field and task."""
    f = banks()["frame"]
    system = [Piece(f["intro"].format(role=d.domain.role) + "\n\n", "intro"),
              Piece(f["policy_header"] + "\n", "policy")]
    system += [Piece(line, "policy") for line in before]
    system.append(Piece("\n" + f["tools_header"] + "\n" + ", ".join(d.tools), "tools"))
    user = rule_pieces(d, "field", f["rule_header"]) + [Piece("\n", "rule")]
    user += example_pieces(d)
    user.append(Piece(f["request"].format(request=d.domain.requests[d.request]) + "\n", "request"))
    user += session_field_last(d)
    if after:
        user.append(Piece(after_header(), "policy_after"))
        user += [Piece(line, "policy_after") for line in after]
    design = suite.design
    task = f["task_field"].format(field=d.domain.field) if design.point_to_field else f["task"]
    user.append(Piece(task, "task"))
    out = [Piece(fr.head, "head"), *system, Piece(fr.mid, "turn_user"), *user,
           Piece(fr.tail, "turn_answer")]
    if design.answer_prefix or not fr.chat:
        out.append(Piece(f["answer_prefix"] + fr.answer_sep, "answer_prefix"))
    return [p for p in out if p.text or p.alt]


def _n_after_field(tok: Any, pieces: list[Piece]) -> tuple[int, int]:
    """(n_tokens, tokens after the field) of a rendered prompt."""
    a = assemble(tok, pieces)
    return len(a.old_ids), len(a.old_ids) - a.span[1]


def layout_draw(suite: Suite, index: int, seed: int, layout: str) -> Draw:
    """The gated draw of one item of a layout suite (distance, order): only a field suite has the
    single field line these layouts move."""
    if suite.kind != "gated" or suite.variant != "field":
        raise ValueError(f"{layout} items need a gated suite of variant field; {suite.name!r} is "
                         f"{suite.kind}/{suite.variant}")
    return draw(suite, index, seed)


def layout_stream(suite: Suite, d: Draw, index: int, seed: int, layout: str) -> Iterator[str]:
    """One item's filler stream, seeded by suite, seed, index and layout name."""
    return filler.filler_stream(random.Random(f"{suite.name}:{seed}:{index}:{layout}"), d.domain.fillers)


def pair_id(item: TaskItem) -> str:
    """An item across the cells of a layout suite (its distances, its order cells): suite, seed,
    index and domain (item_id adds the cell)."""
    return f"{item.suite}/s{item.seed}/{int(item.meta['index']):04d}/{item.domain}"


def _draw(suite: Suite, index: int, seed: int) -> Draw:
    return layout_draw(suite, index, seed, "distance")


def _stream(suite: Suite, d: Draw, index: int, seed: int) -> Iterator[str]:
    return layout_stream(suite, d, index, seed, "distance")


def _after_lines(tok: Any, suite: Suite, d: Draw, fr: Frame, lines: Any, distance: int) -> list[str]:
    """Filler lines after the field that bring its distance to `distance` (within a few tokens)."""
    _, closing = _n_after_field(tok, distance_pieces(suite, d, fr, [], []))
    if distance < closing - SLACK:
        raise ValueError(f"distance {distance} is below the {closing} tokens that follow the field "
                         f"with no filler (item {d.domain.name}, this tokenizer); use >= {closing - SLACK}")
    budget = distance - closing - len(encode(tok, after_header()))
    return filler.fit(tok, lines, budget) if budget > 0 else []


def min_distance(suite: Suite, tok: Any, fr: Frame, index: int, seed: int) -> int:
    """The shortest distance item `index` can have: the closing after the field, no filler."""
    return _n_after_field(tok, distance_pieces(suite, _draw(suite, index, seed), fr, [], []))[1]


def shortest_length(suite: Suite, tok: Any, fr: Frame, index: int, distance: int, seed: int) -> int:
    """Tokens of item `index` at `distance` with no filler before the field: the least `length`."""
    d = _draw(suite, index, seed)
    after = _after_lines(tok, suite, d, fr, _stream(suite, d, index, seed), distance)
    return _n_after_field(tok, distance_pieces(suite, d, fr, [], after))[0]


def build_distance_item(suite: Suite, tok: Any, fr: Frame, index: int, distance: int, length: int,
                        seed: int) -> TaskItem:
    """Item `index` with its field `distance` tokens before the decision, `length` tokens in all
    (both met within a few tokens; `meta` holds the targets, `distance_tokens` the actual one)."""
    d = _draw(suite, index, seed)
    lines = _stream(suite, d, index, seed)
    after = _after_lines(tok, suite, d, fr, lines, distance)
    n0, _ = _n_after_field(tok, distance_pieces(suite, d, fr, [], after))
    if length < n0:
        raise ValueError(f"length {length} is below the {n0} tokens item {index} needs at distance "
                         f"{distance}; use length >= {n0} (or null: the shortest that fits)")
    before = filler.fit(tok, lines, length - n0)
    a = assemble(tok, distance_pieces(suite, d, fr, before, after))
    dom = d.domain
    v_old, v_new = dom.values[d.value], dom.values[1 - d.value]
    return TaskItem(
        item_id=f"{suite.name}/s{seed}/L{length}/D{distance}/{index:04d}/{dom.name}",
        suite=suite.name,
        domain=dom.name,
        template_id=f"{dom.name}/rule{d.rule}/req{d.request}",
        seed=seed,
        variant=suite.variant,
        field_name=dom.field,
        old_value=v_old,
        new_value=v_new,
        correct_old=outcome_for(d, d.value, 0),
        correct_new=outcome_for(d, 1 - d.value, 0),
        **rendered_fields(tok, a, dom.outcomes, fr.chat),
        meta={"length": length, "distance": distance, "distance_tokens": len(a.old_ids) - a.span[1],
              "index": index, "layout": LAYOUT, "fewshot": suite.design.fewshot},
    )


def check_distances(distances: Sequence[int]) -> list[int]:
    ds = [int(x) for x in distances]
    if not ds or any(x < 1 for x in ds) or len(set(ds)) != len(ds):
        raise ValueError(f"distances must be distinct ints >= 1, got {list(distances)}")
    return sorted(ds)


def build_distance_suite(
    suite: str,
    tokenizer: Any,
    chat: bool = True,
    distances: Sequence[int] = (32, 64, 128, 256, 512, 1024),
    n_items: int | None = None,
    length: int | None = None,
    seed: int | None = None,
    template_dirs: Sequence[str | Path] = (),
    domains: Sequence[str] | None = None,
    design: Mapping[str, Any] | None = None,
) -> list[TaskItem]:
    """Items 0..n_items-1 of a gated suite, each rendered at every distance (index-major order).

    `length` None gives each item the shortest length that fits its longest distance, so at that
    distance nothing precedes the field's session but the rule, demonstrations and request.
    `domains` and `design` subset and override as in `build_suite` (design.rule_position has no
    effect here: the layout fixes it). A distance below an item's closing, or a length below what
    a distance needs, raises before anything is returned.
    """
    s = configured_suite(suite, template_dirs, domains, design)
    ds = check_distances(distances)
    n = s.n_items if n_items is None else n_items
    sd = s.seed if seed is None else seed
    if n < 1:
        raise ValueError(f"n_items must be >= 1, got {n}")
    fr = frame(tokenizer, chat)
    closing = max(min_distance(s, tokenizer, fr, i, sd) for i in range(n))
    if ds[0] < closing - SLACK:
        raise ValueError(f"distance {ds[0]} is below the {closing} tokens that follow the field with "
                         f"no filler under this tokenizer (chat={fr.chat}); use distances >= {closing - SLACK}")
    out = []
    for i in range(n):
        L = shortest_length(s, tokenizer, fr, i, ds[-1], sd) if length is None else length
        out += [build_distance_item(s, tokenizer, fr, i, dist, L, sd) for dist in ds]
    return out
