"""Experiment `edit`: the editable cache's cost/correctness frontier (its driver,
experiments/shared/edits.py, also runs `ksweep` and `wording`; the strategies are
kvnotes.edit.registry's).

For every item the stale cache (old prompt) is prefilled once; each strategy then builds its
edited state from it and reads the decision. Against the oracle (a clean prefill of the new
prompt, timed in the same loop): P(correct) (argmax among outcomes equals the oracle's),
recovery (score relative to stale 0 and oracle 1), recompute fraction, and time ratio (edit
time / full re-prefill time, measured side by side per item). Items are usable for recovery when
|score_oracle - score_stale| >= margin, for P(correct) when in addition stale and oracle argmax
are both correct. Decisions are calibrated when the item has a content-free prompt (the field set
to N/A): each state's outcome logits minus the content-free ones, the same offset for every state
of the item (`pick_raw` keeps the uncalibrated argmax; the summary's `p_correct_raw` reads P(correct)
that way, over the items whose raw stale and oracle picks are correct). Paper: erratum 1.00, field-only 0.00
without CoT, CacheBlend@15 % 0.13. Selective strategies' times exclude ranking the positions (the
`copy` variant and the effect ranking also need the oracle cache).

    python -m experiments.run +experiment=edit model=qwen-1.5b task=gated
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.shared.edits import drive, summarize_states
from kvnotes.edit import registry
from kvnotes.edit.strategies import ERRATA, Editor, EditState

if TYPE_CHECKING:
    from experiments.shared.context import Context

# every registered strategy; the oracle is always read beside them (it is the reference)
STRATEGIES = tuple(n for n in registry.names() if n != "oracle")


@dataclass
class EditConfig:
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    k: int = 8  # selective@K
    wording: str = "explicit"  # erratum wording (see kvnotes.edit.strategies.ERRATA)
    template: str | None = None  # custom erratum template with {field} and {value}
    cacheblend_fraction: float = 0.15
    check_layer: int = 1
    margin: float | None = None  # None: the model config's margin
    cot: bool = False  # also read each of `cot_strategies` after a greedy reasoning
    cot_tokens: int = registry.COT_TOKENS
    cot_strategies: list[str] = field(default_factory=lambda: ["field_only", "erratum"])
    cot_only: bool = False  # record only the CoT reads (a run beside a plain edit run; implies cot)

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies + self.cot_strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; valid: {', '.join(STRATEGIES)} "
                             "(kvnotes.edit.registry)")
        if self.wording not in ERRATA:
            raise ValueError(f"wording {self.wording!r}; valid: {', '.join(ERRATA)}")
        if self.k < 0 or not 0 < self.cacheblend_fraction <= 1 or self.check_layer < 0:
            raise ValueError("k >= 0, 0 < cacheblend_fraction <= 1, check_layer >= 0")


def _edit_states(ed: Editor, cfg: EditConfig) -> list[EditState]:
    opts = registry.EditOptions(cfg.k, cfg.wording, cfg.template, cfg.cacheblend_fraction, cfg.check_layer)
    return [registry.get(s).build(ed, opts) for s in cfg.strategies if s != "stale"]


def summarize(records: Sequence[Mapping[str, Any]], cfg: EditConfig) -> dict[str, Any]:
    return summarize_states(records)


def run(ctx: Context) -> None:
    cfg: EditConfig = ctx.params
    drive(ctx, lambda ed: (_edit_states(ed, cfg), None), cfg.margin, cfg)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "edit"
CONFIG = EditConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = "edit strategies: P(correct), recovery, recompute fraction, time vs full re-prefill"
