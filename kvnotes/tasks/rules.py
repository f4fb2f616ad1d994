"""Binding rules: fill a phrasing for a domain, and check that what it renders says what it should.

A gated domain declares `values[i] -> outcomes[i]`. A rule phrasing names both cases with the
placeholders {v0} {o0} {v1} {o1}; the builder states the cases in seeded order by swapping the
two *pairs* together, so the mapping stays as declared. A one-sided phrasing ("renewed only when
{field} is {v0}") hides an outcome in fixed words, and swapping its cases turns it into a
contradiction. So every phrasing a suite can draw is rendered in both orders and checked: both
values and both outcomes appear (as whole words), and each value is followed by its own outcome
before the next value (or each outcome by its own value, for "answer {o0} when ... {v0}" forms).
Polarity phrasings are one-sided by design ("{trigger} {field} is {v0}, ... {o0}; otherwise ...
{o1}"): there the stated value must pair with its outcome and the other outcome must appear.

Before any rendering, a phrasing may use only its declared placeholders, bare ({field} {v0} {v1}
{o0} {o1}, and {trigger} in a polarity suite): no attribute or index access, conversion or spec.
And no case may be stated by negation ("If {field} is not {v0}, ... {o0}", "Unless ...",
"except when ..."): the pairing check reads the value next to its outcome and would take the
negated case for the declared one, so a rule saying the opposite of its domain would pass.
Polarity suites negate through their {trigger} word, never in the phrasing's own words. The
negation check reads a folded copy of the phrasing (NFKC, zero-width and combining characters
dropped, curly apostrophes and Cyrillic or Greek look-alikes of Latin letters mapped to Latin), so
`isn’t`, `no<ZWSP>t` or a Cyrillic о in `not` are read as what they show; what stays ambiguous after
folding (an invisible, bidirectional or control character; a word mixing Latin with another
script) is refused.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from kvnotes.tasks.domains import Domain, banks, control_problem, format_problem

POLARITY_VARIANTS = ("polarity", "trigger")
EXAMPLE = "If {field} is {v0}, the next action is {o0}. If {field} is {v1}, the next action is {o1}."
PLACEHOLDERS = ("field", "v0", "v1", "o0", "o1")
NEGATION = re.compile(
    r"\b(not|never|unless|except|excepting|excluding|neither|nor|without|cannot"
    r"|isnt|arent|wasnt|werent|doesnt|dont|didnt|cant|wont"
    r"|other\s+than|anything\s+but|all\s+but|but\s+not|apart\s+from|aside\s+from|save\s+for"
    r"|instead\s+of|rather\s+than)\b|\Bn't\b", re.IGNORECASE)
# Cyrillic and Greek letters drawn like Latin ones (Unicode's confusables, the common subset), and
# the apostrophes a contraction may be typed with
LOOKALIKES = str.maketrans({
    **dict(zip("аеһіјкмнорстухԁѕԛԝӏ", "aehijkmhopctyxdsqwl", strict=True)),
    **dict(zip("АВЕНІЈКМОРСТУХЅ", "ABEHIJKMOPCTYXS", strict=True)),
    **dict(zip("αβεηικμνορτυχ", "abenikmvoptux", strict=True)),
    **dict(zip("ΑΒΕΖΗΙΚΜΝΟΡΤΥΧ", "ABEZHIKMNOPTYX", strict=True)),
    **dict.fromkeys("\u2019\u2018\u02bc\u2032\u0060\u00b4", "'"),
})


def fold(text: str) -> str:
    """`text` as a reader sees it: NFKC (no-break and other spaces become spaces), zero-width and
    other format characters and combining marks dropped, look-alike letters and apostrophes mapped."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if unicodedata.category(c) not in ("Cf", "Mn"))
    return unicodedata.normalize("NFC", text).translate(LOOKALIKES)


def _script(c: str) -> str:
    return unicodedata.name(c, "?").split(" ")[0]


def mixed_script(text: str) -> str | None:
    """The first word that mixes Latin letters with letters of another script, or None."""
    for word in re.findall(r"[^\W\d_]+", unicodedata.normalize("NFKC", text)):
        scripts = {_script(c) for c in word}
        if "LATIN" in scripts and len(scripts) > 1:
            return word
    return None


def negation(template: str) -> str | None:
    """The first negating word of a phrasing's own text (its placeholders left out, read folded), or None."""
    m = NEGATION.search(fold(re.sub(r"\{[^{}]*\}", " ", template)))
    return m.group(0) if m else None


def template_problem(template: str, variant: str) -> str | None:
    """What is wrong with a phrasing before it is rendered: a placeholder other than the declared
    ones, or a case stated by negation; None when it may be rendered and checked."""
    allowed = (*PLACEHOLDERS, "trigger") if variant in POLARITY_VARIANTS else PLACEHOLDERS
    problem = format_problem(template, allowed)
    if problem:
        return problem
    word = negation(template)
    if word:
        return (f"it states a case by negation ({word!r}), which the pairing check would read as "
                "the case itself; state each value positively with its own outcome")
    problem = control_problem(template)
    if problem:
        return problem
    word = mixed_script(template)
    if word:
        return (f"its word {word!r} mixes Latin letters with another script, which reads as one word "
                "and checks as another; write it in one script")
    return None


def rule_phrasings(domain: Domain, variant: str) -> list[str]:
    """Every phrasing an item of `variant` may draw for `domain` (the domain's own, then the bank's)."""
    if variant in POLARITY_VARIANTS:
        return list(banks()["polarity_rules"])
    return list(domain.rules) + list(banks()["rules"])


def fill_rule(template: str, domain: Domain, order: int, **kw: Any) -> str:
    """`template` filled; `order=1` states the second case first (both pairs swap together)."""
    a, b = (1, 0) if order else (0, 1)
    return template.format(field=domain.field, v0=domain.values[a], v1=domain.values[b],
                           o0=domain.outcomes[a], o1=domain.outcomes[b], **kw)


def _mentions(text: str, words: tuple[str, str], kind: str) -> list[tuple[int, str, int]]:
    """(offset, kind, index) of every whole-word occurrence of words[0] and words[1]."""
    out = []
    for i, w in enumerate(words):
        for m in re.finditer(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text):
            out.append((m.start(), kind, i))
    return out


def rule_problem(text: str, domain: Domain, one_sided: bool = False) -> str | None:
    """What is wrong with a rendered rule, or None when it states the mapping as declared.

    A case is a mention of one kind (value or outcome, whichever the rule starts with) followed
    by a mention of the other kind: each case must pair index i with index i, and a two-sided
    rule must state both cases.
    """
    values, outcomes = domain.values, domain.outcomes
    seq = sorted(_mentions(text, values, "v") + _mentions(text, outcomes, "o"))
    for kind, words in (("o", outcomes), ("v", values)):
        seen = {i for _, k, i in seq if k == kind}
        need = {0} if kind == "v" and one_sided else {0, 1}
        if len(seen) < len(need):
            missing = " or ".join(repr(words[i]) for i in (0, 1) if i not in seen)
            return f"it never names the {'value' if kind == 'v' else 'outcome'} {missing}"
    lead = seq[0][1]
    cases = [(i1, i2) for (_, k1, i1), (_, k2, i2) in zip(seq, seq[1:], strict=False)
             if k1 == lead and k2 != lead]
    for a, b in cases:
        v, o = (a, b) if lead == "v" else (b, a)
        if v != o:
            return (f"it pairs {values[v]!r} with {outcomes[o]!r}, but the domain declares "
                    f"{values[v]!r} -> {outcomes[v]!r}")
    stated = {a for a, _ in cases}
    if len(stated) < (1 if one_sided else 2):
        return "it does not state each value with its outcome"
    return None


def check_rules(suite_name: str, variant: str, domains: tuple[Domain, ...]) -> None:
    """Render every phrasing each domain may draw, in both orders; raise on the first bad one."""
    one_sided = variant in POLARITY_VARIANTS
    for d in domains:
        for template in rule_phrasings(d, variant):
            problem = template_problem(template, variant)
            if problem:
                raise ValueError(f"suite {suite_name!r}, domain {d.name!r}: rule {template!r}: {problem} "
                                 f"(e.g. {EXAMPLE!r}; kvnotes/tasks/README.md, 'Adding a suite')")
            for order in (0, 1):
                try:
                    text = fill_rule(template, d, order, trigger=banks()["triggers"][0])
                except (KeyError, IndexError) as e:
                    raise ValueError(f"suite {suite_name!r}, domain {d.name!r}: rule {template!r} uses "
                                     f"an unknown placeholder {e}; valid: {{field}} {{v0}} {{v1}} "
                                     f"{{o0}} {{o1}}") from None
                problem = rule_problem(text, d, one_sided)
                if problem:
                    raise ValueError(
                        f"suite {suite_name!r}, domain {d.name!r}: rule {template!r} renders as "
                        f"{text!r}, and {problem}; state both cases, each value with its outcome, "
                        f"e.g. {EXAMPLE!r} (kvnotes/tasks/README.md, 'Adding a suite')"
                    )
