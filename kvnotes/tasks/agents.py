"""Multi-turn agent scenarios: several skills, a state block, and requests across turns.

Skills are gated domains rendered as standalone blocks (tokenized alone, so they can be
prefilled once and transplanted). The state block holds each skill's field; between turns a
field may change. `render(..., mode="erratum")` keeps the initial state and appends the change
as an update line in the user turn (append-only: the prefix stays byte-identical);
`mode="inplace"` rewrites the state block instead (the full-recompute reference). Each turn's
correct action follows the current state.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvnotes.tasks import filler
from kvnotes.tasks.domains import Domain, banks, builtin_domains
from kvnotes.tasks.gated import rule_phrasings
from kvnotes.tasks.tokens import (
    SENTINEL_SYSTEM,
    SENTINEL_USER,
    Piece,
    assemble,
    bos_text,
    decision_ids,
    has_chat,
    space_is_separate,
)

ANSWER_PREFIX = "Next action:"
_SENT_A = "\x00KVNOTES_ASSISTANT\x00"
_SENT_U2 = "\x00KVNOTES_USER2\x00"


@dataclass(frozen=True)
class AgentTurn:
    domain: str
    request: str
    updates: tuple[tuple[str, str], ...]  # (field, new value) applied before this turn
    correct: str


@dataclass(frozen=True)
class AgentScenario:
    scenario_id: str
    seed: int
    chat: bool
    domains: tuple[str, ...]
    state0: Mapping[str, str]
    blocks: Mapping[str, tuple[str, ...]]  # domain -> block lines (header, rule, filler)
    turns: tuple[AgentTurn, ...]

    def state_at(self, turn: int) -> dict[str, str]:
        """The state every field holds when turn `turn` is asked (updates applied)."""
        state = dict(self.state0)
        for t in self.turns[: turn + 1]:
            state.update(dict(t.updates))
        return state


@dataclass(frozen=True)
class AgentPrompt:
    """One rendered turn: ids up to the decision, segments and the decision readout."""

    ids: tuple[int, ...]
    text: str
    segments: dict[str, tuple[int, int]] = field(default_factory=dict)
    outcomes: tuple[str, ...] = ()
    decision_ids: tuple[int, ...] = ()
    correct: str = ""

    @property
    def decision_pos(self) -> int:
        return len(self.ids) - 1


def _domain(name: str) -> Domain:
    return builtin_domains()[name]


def block_lines(d: Domain, tok: Any, budget: int, rng: random.Random) -> tuple[str, ...]:
    a = banks()["agent"]
    rule = rule_phrasings(d, "field")[0].format(
        field=d.field, v0=d.values[0], v1=d.values[1], o0=d.outcomes[0], o1=d.outcomes[1])
    fill = filler.fit(tok, filler.filler_stream(rng, d.fillers), budget)
    half = len(fill) // 2
    return (a["skill_header"].format(name=d.name) + "\n", *fill[:half], f"- Rule: {rule}\n",
            *fill[half:], "\n")


def build_scenarios(
    tokenizer: Any, chat: bool = True, n: int = 8, seed: int = 0, n_skills: int = 3,
    n_turns: int = 4, block_length: int = 200, domains: list[str] | None = None,
) -> list[AgentScenario]:
    """`n` seeded scenarios; each turn asks one skill's decision, most turns change a field."""
    names = sorted(domains or builtin_domains())
    if n_skills > len(names):
        raise ValueError(f"n_skills {n_skills} > {len(names)} domains")
    out = []
    for k in range(n):
        rng = random.Random(f"agents:{seed}:{k}")
        chosen = rng.sample(names, n_skills)
        doms = [_domain(c) for c in chosen]
        state = {d.field: rng.choice(d.values) for d in doms}
        state0 = dict(state)
        turns = []
        for t in range(n_turns):
            d = doms[t % n_skills] if t < n_skills else rng.choice(doms)
            updates: list[tuple[str, str]] = []
            if t > 0 and rng.random() < 0.75:
                target = d if rng.random() < 0.7 else rng.choice(doms)
                new = next(v for v in target.values if v != state[target.field])
                updates.append((target.field, new))
                state[target.field] = new
            correct = d.outcomes[d.values.index(state[d.field])]
            turns.append(AgentTurn(d.name, rng.choice(d.requests), tuple(updates), correct))
        blocks = {d.name: block_lines(d, tokenizer, block_length, random.Random(f"{rng.random()}"))
                  for d in doms}
        out.append(AgentScenario(f"agents/{seed}/{k:04d}", seed, chat and has_chat(tokenizer),
                                 tuple(chosen), state0, blocks, tuple(turns)))
    return out


def _wrappers(tok: Any, chat: bool) -> dict[str, str]:
    """Template text around system, user and assistant turns (or completion-style labels)."""
    if not (chat and has_chat(tok)):
        return {"head": bos_text(tok), "mid": "\n\nUser: ", "a_open": "\nAssistant: ",
                "a_close": "\n\nUser: ", "tail": "\nAssistant: "}
    msgs = [{"role": "system", "content": SENTINEL_SYSTEM}, {"role": "user", "content": SENTINEL_USER},
            {"role": "assistant", "content": _SENT_A}, {"role": "user", "content": _SENT_U2}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    head, rest = text.split(SENTINEL_SYSTEM)
    mid, rest = rest.split(SENTINEL_USER)
    a_open, rest = rest.split(_SENT_A)
    a_close, tail = rest.split(_SENT_U2)
    return {"head": head, "mid": mid, "a_open": a_open, "a_close": a_close, "tail": tail}


def _user_text(turn: AgentTurn, mode: str) -> str:
    lines = []
    if mode == "erratum":
        lines += [banks()["agent"]["update"].format(field=f, value=v) + "\n" for f, v in turn.updates]
    lines.append(f"Request: {turn.request}\nReply with the name of the next action only.")
    return "".join(lines)


def render(sc: AgentScenario, tok: Any, turn: int, mode: str = "erratum") -> AgentPrompt:
    """The prompt of turn `turn` (earlier turns answered correctly), ending at the decision."""
    if mode not in ("erratum", "inplace"):
        raise ValueError(f"mode {mode!r}; valid: erratum, inplace")
    w = _wrappers(tok, sc.chat)
    a = banks()["agent"]
    state = dict(sc.state0) if mode == "erratum" else sc.state_at(turn)
    pieces = [Piece(w["head"], "head"), Piece(a["intro"] + "\n\n", "intro")]
    for name in sc.domains:
        pieces += [Piece(line, f"skill:{name}") for line in sc.blocks[name]]
    pieces.append(Piece(a["state_header"] + "\n", "state"))
    pieces += [Piece(f"{k}: {v}\n", "state") for k, v in state.items()]
    pieces.append(Piece(w["mid"], "turn"))
    for j, t in enumerate(sc.turns[: turn + 1]):
        pieces.append(Piece(_user_text(t, mode), f"user:{j}"))
        if j < turn:
            pieces += [Piece(w["a_open"], "turn"), Piece(f"{ANSWER_PREFIX} {t.correct}", f"answer:{j}"),
                       Piece(w["a_close"], "turn")]
    sep = " " if space_is_separate(tok) else ""
    pieces += [Piece(w["tail"], "turn"), Piece(ANSWER_PREFIX + sep, "answer_prefix")]
    asm = assemble(tok, [p for p in pieces if p.text], mutable=False)
    d = _domain(sc.turns[turn].domain)
    return AgentPrompt(asm.old_ids, asm.old_text, asm.segments, d.outcomes,
                       decision_ids(tok, d.outcomes, asm.old_text), sc.turns[turn].correct)
