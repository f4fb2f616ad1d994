"""Gated decision items: a session field near the top, a policy, a binding rule, a request.

Layout (chat: system = intro, session, policy, tools; user = rule, examples, request, task;
completion: the same text as one document): the field sits in the session block near the top,
neutral filler rules pad the policy to the requested length, and the prompt ends right before
the decision (`Next action:`). Variants: `field` flips the gating value; `control` flips a
request_id or current_time that must not matter; `polarity` flips the field under a rule whose
trigger word (If / Unless) may invert it (the 2x2 design); `trigger` flips only the trigger word
with the field byte-identical.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.domains import Domain, banks
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.rules import fill_rule, rule_phrasings
from kvnotes.tasks.templates import Suite
from kvnotes.tasks.tokens import (
    Frame,
    Piece,
    assemble,
    rendered_fields,
)


@dataclass(frozen=True)
class Draw:
    """The seeded choices of one item, before rendering."""

    domain: Domain
    value: int  # index of the gating value in the old prompt
    flip: str  # which slot changes: field | request_id | current_time | trigger
    polarity: int  # trigger word index in the old prompt (0 = If: no inversion)
    rule: int
    request: int
    context: dict[str, str]
    controls: tuple[dict[str, str], dict[str, str]]  # old / new control values
    examples: tuple[int, ...]  # value index of each demonstration, in order
    tools: tuple[str, ...]
    order: int = 0  # 1: the rule states the second value's case first


def _num(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _controls(rng: random.Random) -> dict[str, str]:
    c = banks()["frame"]["controls"]
    return {
        "request_id": c["request_id"].format(num=_num(rng)),
        "current_time": c["current_time"].format(
            month=rng.randint(1, 9), day=rng.randint(0, 9), hour=rng.randint(10, 17),
            minute=rng.randint(10, 59),
        ),
    }


def draw(suite: Suite, index: int, seed: int) -> Draw:
    """Seeded, balanced choices: domains round-robin, old value and polarity alternate."""
    rng = random.Random(f"{suite.name}:{seed}:{index}")
    nd = len(suite.domains)
    domain = suite.domains[index % nd]
    value = (index // nd) % 2
    polarity = (index // (2 * nd)) % 2 if suite.variant in ("polarity", "trigger") else 0
    flip = {"field": "field", "polarity": "field", "trigger": "trigger"}.get(suite.variant)
    if flip is None:
        flip = ("request_id", "current_time")[(index // nd + index // (2 * nd)) % 2]
    name = rng.choice(banks()["names"])
    num = _num(rng)
    context = {k: v.format(name=name, num=num) for k, v in domain.context.items()}
    old_c = _controls(rng)
    new_c = dict(old_c)
    while flip in old_c and new_c[flip] == old_c[flip]:
        new_c[flip] = _controls(rng)[flip]
    examples = [0, 1] * (suite.design.fewshot // 2)
    rng.shuffle(examples)
    tools = list(domain.outcomes) + list(domain.distractors)
    rng.shuffle(tools)
    return Draw(
        domain=domain,
        value=value,
        flip=flip,
        polarity=polarity,
        rule=rng.randrange(len(rule_phrasings(domain, suite.variant))),
        request=rng.randrange(len(domain.requests)),
        context=context,
        controls=(old_c, new_c),
        examples=tuple(examples),
        tools=tuple(tools),
        order=rng.randrange(2),
    )


def outcome_for(d: Draw, value: int, polarity: int) -> str:
    """The correct action for a gating value under a rule polarity (1 inverts)."""
    return d.domain.outcomes[value ^ polarity]


def _fmt(template: str, d: Draw, **kw: Any) -> str:
    """Fill a rule; `order` swaps both cases together, which keeps the mapping it states."""
    return fill_rule(template, d.domain, d.order, **kw)


def rule_pieces(d: Draw, variant: str, lead: str) -> list[Piece]:
    """The binding rule after `lead` ("-" or "Binding rule:"); the trigger word may be mutable."""
    template = rule_phrasings(d.domain, variant)[d.rule]
    if variant not in ("polarity", "trigger"):
        return [Piece(f"{lead} {_fmt(template, d)}\n", "rule")]
    triggers = banks()["triggers"]
    before, after = template.split("{trigger}")
    head = f"{lead} {_fmt(before, d)}".rstrip()
    rest = _fmt(after, d) + "\n"
    old = " " + triggers[d.polarity]
    alt = " " + triggers[1 - d.polarity] if d.flip == "trigger" else None
    return [Piece(head, "rule"), Piece(old, "rule", alt), Piece(rest, "rule")]


def session_pieces(d: Draw) -> list[Piece]:
    """Session block: first context line, the gating field, other context, then the controls."""
    dom = d.domain
    ctx = list(d.context.items())
    lines: list[Piece] = [Piece(banks()["frame"]["session_header"] + "\n", "session")]
    for k, v in ctx[:1]:
        lines.append(Piece(f"{k}: {v}\n", "session"))
    value = " " + dom.values[d.value]
    cf = " " + banks()["frame"]["content_free"]
    alt = " " + dom.values[1 - d.value] if d.flip == "field" else None
    lines += [Piece(f"{dom.field}:", "session"), Piece(value, "session", alt, cf if alt else None),
              Piece("\n", "session")]
    for k, v in ctx[1:]:
        lines.append(Piece(f"{k}: {v}\n", "session"))
    old_c, new_c = d.controls
    for k in ("request_id", "current_time"):
        alt = " " + new_c[k] if d.flip == k else None
        # no content-free value for a control: "N/A" there says nothing about the gating field,
        # so controls are read raw (calibrating them would only add noise)
        lines += [Piece(f"{k}:", "session"), Piece(" " + old_c[k], "session", alt),
                  Piece("\n", "session")]
    return lines


def example_pieces(d: Draw) -> list[Piece]:
    if not d.examples:
        return []
    f = banks()["frame"]
    out = [Piece(f["examples_header"] + "\n", "examples")]
    for v in d.examples:
        line = f["example"].format(
            field=d.domain.field, value=d.domain.values[v], outcome=outcome_for(d, v, d.polarity)
        )
        out.append(Piece(line + "\n", "examples"))
    return out + [Piece("\n", "examples")]


def prompt_pieces(suite: Suite, d: Draw, fr: Frame, fill: list[str]) -> list[Piece]:
    """The whole prompt, in order, with `fill` as the policy's filler lines."""
    f = banks()["frame"]
    design = suite.design
    at_question = design.rule_position == "question"
    system = [Piece(f["intro"].format(role=d.domain.role) + "\n\n", "intro")]
    system += session_pieces(d)
    system.append(Piece("\n" + f["policy_header"] + "\n", "policy"))
    system += [Piece(line, "policy") for line in fill]
    if not at_question:
        system += rule_pieces(d, suite.variant, "-")
    system.append(Piece("\n" + f["tools_header"] + "\n" + ", ".join(d.tools), "tools"))
    user: list[Piece] = []
    if at_question:
        user += rule_pieces(d, suite.variant, f["rule_header"]) + [Piece("\n", "rule")]
    user += example_pieces(d)
    request = f["request"].format(request=d.domain.requests[d.request])
    task = f["task_field"].format(field=d.domain.field) if design.point_to_field else f["task"]
    user += [Piece(request + "\n", "request"), Piece(task, "task")]
    out = [Piece(fr.head, "head"), *system, Piece(fr.mid, "turn_user"), *user,
           Piece(fr.tail, "turn_answer")]
    if design.answer_prefix or not fr.chat:
        out.append(Piece(f["answer_prefix"] + fr.answer_sep, "answer_prefix"))
    return [p for p in out if p.text or p.alt]


def _values(d: Draw) -> tuple[str, str, str]:
    """(slot name, old value, new value) of the mutable piece."""
    dom = d.domain
    if d.flip == "field":
        return dom.field, dom.values[d.value], dom.values[1 - d.value]
    if d.flip == "trigger":
        t = banks()["triggers"]
        return "trigger", t[d.polarity], t[1 - d.polarity]
    return d.flip, d.controls[0][d.flip], d.controls[1][d.flip]


def _correct(d: Draw) -> tuple[str, str]:
    if d.flip == "field":
        return outcome_for(d, d.value, d.polarity), outcome_for(d, 1 - d.value, d.polarity)
    if d.flip == "trigger":
        return outcome_for(d, d.value, d.polarity), outcome_for(d, d.value, 1 - d.polarity)
    c = outcome_for(d, d.value, 0)
    return c, c


def _skeleton(suite: Suite, tok: Any, fr: Frame, d: Draw) -> int:
    return len(assemble(tok, prompt_pieces(suite, d, fr, [])).old_ids)


def skeleton_length(suite: Suite, tok: Any, fr: Frame, index: int, seed: int) -> int:
    """Tokens of item `index` without filler: the least `length` `build_item` renders it at."""
    return _skeleton(suite, tok, fr, draw(suite, index, seed))


def build_item(suite: Suite, tok: Any, fr: Frame, index: int, length: int, seed: int) -> TaskItem:
    """Render item `index` of a gated suite at `length` tokens (within a few tokens)."""
    if suite.variant == "trigger" and suite.design.fewshot:
        raise ValueError("trigger variant: demonstrations would contradict one of the rules; fewshot=0")
    d = draw(suite, index, seed)
    base = _skeleton(suite, tok, fr, d)
    if length < base:
        raise ValueError(f"length {length} is below the {base} tokens item {index} needs without filler")
    rng = random.Random(f"{suite.name}:{seed}:{index}:filler")
    fill = filler.fit(tok, filler.filler_stream(rng, d.domain.fillers), length - base)
    a = assemble(tok, prompt_pieces(suite, d, fr, fill))
    name, old_v, new_v = _values(d)
    correct_old, correct_new = _correct(d)
    return TaskItem(
        item_id=f"{suite.name}/s{seed}/L{length}/{index:04d}/{d.domain.name}",
        suite=suite.name,
        domain=d.domain.name,
        template_id=f"{d.domain.name}/rule{d.rule}/req{d.request}",
        seed=seed,
        variant=suite.variant,
        field_name=name,
        old_value=old_v,
        new_value=new_v,
        correct_old=correct_old,
        correct_new=correct_new,
        polarity=d.polarity,
        **rendered_fields(tok, a, d.domain.outcomes, fr.chat),
        meta={"length": length, "fewshot": suite.design.fewshot,
              "rule_position": suite.design.rule_position},
    )
