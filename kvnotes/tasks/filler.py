"""Neutral filler rules and token-budget fitting.

Filler lines are drawn without repeats from templates x slot values (thousands of distinct
lines) mixed with a domain's own neutral rules. Because pieces are tokenized one by one, a
prompt's length is the sum of its pieces' lengths: lines are added greedily while they fit the
budget, then the remaining gap is closed with the best-fitting short line, so a requested length
is met to within a few tokens (the tests hold it to 5 %).
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

from kvnotes.tasks.domains import banks
from kvnotes.tasks.tokens import encode

_SLOT = re.compile(r"{(\w+)}")


def _expand(template: str, slots: dict[str, list[str]]) -> list[str]:
    names = _SLOT.findall(template)
    out = []
    for combo in itertools.product(*(slots[n] for n in names)):
        line = template.format(**dict(zip(names, combo, strict=True)))
        out.append(line[0].upper() + line[1:])
    return out


def all_filler_lines() -> list[str]:
    """Every generic filler line the bank can produce (deterministic order)."""
    b = banks()
    slots = {k: list(v) for k, v in b["filler_slots"].items()}
    return [line for t in b["fillers"] for line in _expand(t, slots)]


_LINES: list[str] | None = None


def _generic() -> list[str]:
    global _LINES
    if _LINES is None:
        _LINES = all_filler_lines()
    return _LINES


def filler_stream(rng: random.Random, domain_fillers: Sequence[str] = ()) -> Iterator[str]:
    """Distinct filler lines in a seeded order; domain rules are spread among the first lines."""
    generic = _generic()
    order = rng.sample(range(len(generic)), len(generic))
    own = list(domain_fillers)
    rng.shuffle(own)
    for k, i in enumerate(order):
        if own and k % 3 == 1:
            yield own.pop()
        yield generic[i]
    yield from own


def fit(
    tok: Any,
    lines: Iterator[str],
    budget: int,
    fmt: str = "- {}\n",
    lookahead: int = 60,
) -> list[str]:
    """Formatted lines whose token counts sum to at most `budget`, as close to it as found."""
    chosen: list[str] = []
    used = 0
    pending: list[tuple[str, int]] = []
    for line in lines:
        text = fmt.format(line)
        n = len(encode(tok, text))
        if used + n <= budget:
            chosen.append(text)
            used += n
            continue
        pending.append((text, n))
        if len(pending) >= lookahead:
            break
    gap = budget - used
    while gap > 0 and pending:
        fits = [(n, k) for k, (_, n) in enumerate(pending) if n <= gap]
        if not fits:
            break
        n, k = max(fits)
        chosen.append(pending.pop(k)[0])
        gap -= n
    return chosen
