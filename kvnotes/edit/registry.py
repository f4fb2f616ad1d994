"""The one registry of edit strategies: each declared once, with its name, whether it needs the
oracle, how its cost is counted, and its implementation.

A strategy brings a stale cache in line with a changed field. `needs_oracle` marks those that read
the new prompt's clean prefill beside their own work (its K/V pasted, or positions ranked by their
patching effect): an upper bound a real system cannot run, kept off cost frontiers. The oracle
itself is a full re-prefill, which a system can run: it is the frontier's costliest point. `cost` says what its recomputed
token count holds. `build` makes the state of one task item from an `Editor`; `on_prompt` says
that `EditableCache.edit` offers it on a user's own prompt. `Editor`, `EditableCache`, the edit
experiments, the frontier figure and the report read this table; a new strategy is one
`register(Strategy(...))` here (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvnotes.edit.strategies import ERRATA, Editor, EditState
from kvnotes.errors import ConfigError

COT_TOKENS = 48  # the default budget of a chain-of-thought read (experiments.edit, the frontier)


@dataclass(frozen=True)
class EditOptions:
    """The knobs strategies read: selective@K, the erratum's wording, CacheBlend's budget."""

    k: int = 8
    wording: str = "explicit"
    template: str | None = None  # a custom erratum with {field} and {value}
    cacheblend_fraction: float = 0.15
    check_layer: int = 1

    def __post_init__(self) -> None:
        if self.wording not in ERRATA:
            raise ConfigError(f"wording {self.wording!r}; valid: {', '.join(ERRATA)}")
        if self.k < 0 or not 0 < self.cacheblend_fraction <= 1 or self.check_layer < 0:
            raise ConfigError("k >= 0, 0 < cacheblend_fraction <= 1, check_layer >= 0")


@dataclass(frozen=True)
class Strategy:
    name: str
    needs_oracle: bool
    cost: str  # what its recomputed tokens count
    build: Callable[[Editor, EditOptions], EditState]
    description: str
    on_prompt: bool = False  # offered by EditableCache.edit
    aliases: tuple[str, ...] = ()


STRATEGIES: dict[str, Strategy] = {}


def register(s: Strategy) -> Strategy:
    """Add a strategy; a name or alias that is taken is refused."""
    taken = {n for t in STRATEGIES.values() for n in (t.name, *t.aliases)}
    clash = sorted({s.name, *s.aliases} & taken)
    if clash:
        raise ValueError(f"edit strategy name(s) {clash} already registered")
    STRATEGIES[s.name] = s
    return s


def names(on_prompt: bool = False) -> list[str]:
    """Registered names in declaration order (`on_prompt`: those EditableCache offers)."""
    return [n for n, s in STRATEGIES.items() if s.on_prompt or not on_prompt]


def get(name: str, on_prompt: bool = False) -> Strategy:
    """The strategy called `name` (or an alias); ConfigError listing the valid names."""
    for s in STRATEGIES.values():
        if name in (s.name, *s.aliases) and (s.on_prompt or not on_prompt):
            return s
    valid = [n for s in STRATEGIES.values() if s.on_prompt or not on_prompt for n in (s.name, *s.aliases)]
    raise ConfigError(f"unknown edit strategy {name!r}; valid: {', '.join(valid)}")


# experiments.ksweep labels its states `mode/ranking`
_KSWEEP = {"copy/effect": "selective_copy", "copy/attention": "selective_copy",
           "recompute/effect": "selective_recompute", "recompute/attention": "selective_recompute_att"}


def base_of(label: str) -> Strategy | None:
    """The strategy behind a record's label: 'selective_copy@8+cot' -> selective_copy,
    'erratum_bare' -> erratum, 'cacheblend@15%' -> cacheblend, 'copy/effect' -> selective_copy;
    None for an unknown label."""
    head = str(label).split("+")[0].split("@")[0]
    head = _KSWEEP.get(head, head)
    if head in STRATEGIES:
        return STRATEGIES[head]
    for wording in ERRATA:
        if head.endswith(f"_{wording}") and head.removesuffix(f"_{wording}") in STRATEGIES:
            return STRATEGIES[head.removesuffix(f"_{wording}")]
    return None


def needs_oracle(label: str) -> bool:
    """Whether a record's strategy label needs the oracle prefill (unknown labels: False)."""
    s = base_of(label)
    return bool(s and s.needs_oracle)


def _selective(mode: str, ranking: str, name: str) -> Callable[[Editor, EditOptions], EditState]:
    def build(ed: Editor, o: EditOptions) -> EditState:
        ranked = ed.rank_by_effect() if ranking == "effect" else ed.rank_by_attention()
        return ed.selective(ranked[: o.k], mode, f"{name}@{o.k}")
    return build


register(Strategy("oracle", False, "every token", lambda ed, o: ed.full_prefill(),
                  "a clean prefill of the new prompt (the reference; its time is the baseline)",
                  on_prompt=True))
register(Strategy("stale", False, "the decision token", lambda ed, o: ed.stale_state(),
                  "the old cache, unchanged"))
register(Strategy("field_only", False, "the field's tokens + the decision token",
                  lambda ed, o: ed.field_only(),
                  "the field's own K/V recomputed in place (the in-place edit)", on_prompt=True))
register(Strategy("full_downstream", False, "every token from the field on",
                  lambda ed, o: ed.full_downstream(),
                  "everything from the field to the end recomputed", on_prompt=True))
register(Strategy("selective_copy", True, "the field + K positions + the decision token",
                  _selective("copy", "effect", "selective_copy"),
                  "the field plus the K downstream positions of largest patching effect, the "
                  "oracle's K/V pasted there (an upper bound)"))
register(Strategy("selective_recompute", True, "the field + K positions + the decision token",
                  _selective("recompute", "effect", "selective_recompute"),
                  "the field plus the K positions of largest patching effect (ranked with the "
                  "oracle), recomputed against their stale neighbours"))
register(Strategy("selective_recompute_att", False, "the field + K positions + the decision token",
                  _selective("recompute", "attention", "selective_recompute_att"),
                  "the field plus the K positions the decision token attends to most, recomputed",
                  on_prompt=True, aliases=("selective",)))
register(Strategy("erratum", False, "the erratum's tokens + the prompt after it",
                  lambda ed, o: ed.erratum(o.wording, o.template),
                  "an update line appended before the question; the prefix stays byte-identical",
                  on_prompt=True))
register(Strategy("field_erratum", False, "the field + the erratum + the prompt after it",
                  lambda ed, o: ed.erratum(o.wording, o.template, with_field=True),
                  "field-only edit and the erratum, in one forward"))
register(Strategy("hoist", False, "every token from the field line's old start",
                  lambda ed, o: ed.hoist(),
                  "the field's line moved, with its new value, to just before the question"))
register(Strategy("cacheblend", False, "r % of the tokens + the check layers' share of a prefill",
                  lambda ed, o: ed.cacheblend(o.cacheblend_fraction, o.check_layer),
                  "CacheBlend: the r % of tokens whose keys deviate most at an early check layer"))
