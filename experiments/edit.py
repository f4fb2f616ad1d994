"""Experiment `edit`: the editable cache's cost/correctness frontier (its driver also runs
`ksweep` and `wording`, experiments/ksweep.py and wording.py).

For every item the stale cache (old prompt) is prefilled once; each strategy then builds its
edited state from it and reads the decision. Against the oracle (a clean prefill of the new
prompt, timed in the same loop): P(correct) (argmax among outcomes equals the oracle's),
recovery (score relative to stale 0 and oracle 1), recompute fraction, and time ratio (edit
time / full re-prefill time, measured side by side per item). Items are usable for recovery when
|score_oracle - score_stale| >= margin, for P(correct) when in addition stale and oracle argmax
are both correct. Decisions are calibrated when the item has a content-free prompt (the field set
to N/A): each state's outcome logits minus the content-free ones, the same offset for every state
of the item (`pick_raw` keeps the uncalibrated argmax). Paper: erratum 1.00, field-only 0.00
without CoT, CacheBlend@15 % 0.13. Selective strategies' times exclude ranking the positions (the
`copy` variant and the effect ranking also need the oracle cache).

    python -m experiments.run +experiment=edit model=qwen-1.5b task=gated
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvnotes.edit_strategies import ERRATA, Editor, EditState
from kvnotes.metrics import ci_dict, prop_dict, range_dict, recovery
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.scoring import decide, outcome_logits

if TYPE_CHECKING:
    from experiments._context import Context

STRATEGIES = ("stale", "field_only", "full_downstream", "selective_copy", "selective_recompute",
              "selective_recompute_att", "erratum", "field_erratum", "hoist", "cacheblend")


@dataclass
class EditConfig:
    strategies: list[str] = field(default_factory=lambda: list(STRATEGIES))
    k: int = 8  # selective@K
    wording: str = "explicit"  # erratum wording (see kvnotes.edit_strategies.ERRATA)
    template: str | None = None  # custom erratum template with {field} and {value}
    cacheblend_fraction: float = 0.15
    check_layer: int = 1
    margin: float | None = None  # None: the model config's margin
    cot: bool = False  # also read each of `cot_strategies` after a greedy reasoning
    cot_tokens: int = 48
    cot_strategies: list[str] = field(default_factory=lambda: ["field_only", "erratum"])
    cot_only: bool = False  # record only the CoT reads (a run beside a plain edit run; implies cot)

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies + self.cot_strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; valid: {', '.join(STRATEGIES)}")
        if self.wording not in ERRATA:
            raise ValueError(f"wording {self.wording!r}; valid: {', '.join(ERRATA)}")
        if self.k < 0 or not 0 < self.cacheblend_fraction <= 1 or self.check_layer < 0:
            raise ValueError("k >= 0, 0 < cacheblend_fraction <= 1, check_layer >= 0")


def _pick(item: TaskItem, logits: Any, cf: Any = None) -> str:
    """The chosen outcome; calibrated against the content-free logits `cf` when given."""
    return item.outcomes[decide(outcome_logits(item, logits), None if cf is None else outcome_logits(item, cf))]


def _score(item: TaskItem, logits: Any) -> float:
    a, b = item.score_ids
    return float(logits[a] - logits[b])


def state_records(item: TaskItem, oracle: EditState, stale: EditState, states: Sequence[EditState],
                  margin: float, extra: Sequence[Mapping[str, Any]] | None = None,
                  cf: Any = None) -> list[dict[str, Any]]:
    """One record per state with P(correct), recovery, cost; usability flags of the item.

    `cf`: the content-free prompt's decision logits; when given, every pick is calibrated by them.
    """
    s_old, s_new = _score(item, stale.logits), _score(item, oracle.logits)
    usable_rec = abs(s_new - s_old) >= margin
    old_pick, new_pick = _pick(item, stale.logits, cf), _pick(item, oracle.logits, cf)
    usable_p = usable_rec and old_pick == item.correct_old and new_pick == item.correct_new
    out = []
    for i, st in enumerate([stale, oracle, *states]):
        s, pick = _score(item, st.logits), _pick(item, st.logits, cf)
        out.append({
            "item_id": item.item_id, "domain": item.domain, "template_id": item.template_id,
            "n_tokens": item.n_tokens, "strategy": st.strategy, "margin": margin,
            "usable_recovery": usable_rec, "usable_p_correct": usable_p,
            "score": s, "score_stale": s_old, "score_oracle": s_new,
            "recovery": float(recovery(s, s_old, s_new)),
            "pick": pick, "oracle_pick": new_pick, "correct": pick == new_pick,
            "pick_raw": _pick(item, st.logits), "calibrated": cf is not None,
            "recomputed": st.recomputed, "recompute_fraction": st.recompute_fraction,
            "seconds": st.seconds, "oracle_seconds": oracle.seconds,
            "time_ratio": st.seconds / oracle.seconds,
            **(dict(extra[i - 2]) if extra and i >= 2 else {}),
        })
    return out


def _margin(ctx: Context, margin: float | None) -> float:
    return float(ctx.cfg.model.margin if margin is None else margin)


def _with_cot(item: TaskItem, ed: Editor, oracle: EditState, stale: EditState, states: list[EditState],
              cfg: EditConfig, margin: float, cf: Any = None) -> list[dict[str, Any]]:
    """Records of the CoT reads: each state, stale and oracle all decided after a reasoning."""
    def cot(st: EditState) -> EditState:
        logits, _ = ed.cot(st, cfg.cot_tokens)
        return dataclasses.replace(st, strategy=f"{st.strategy}+cot", logits=logits)

    chosen = [st for st in states if st.strategy.split("@")[0] in cfg.cot_strategies]
    rows = state_records(item, cot(oracle), cot(stale), [cot(st) for st in chosen], margin, cf=cf)
    return [r | {"cot": True} for r in rows]


def drive(ctx: Context, build: Callable[[Editor], tuple[list[EditState], list[dict[str, Any]] | None]],
           margin: float | None, cot: EditConfig | None = None) -> None:
    """Per item (a resumable unit): stale + oracle timed side by side, then the strategies."""
    m = _margin(ctx, margin)
    items = {f"item-{it.item_id}": it for it in ctx.items()}
    for key in ctx.pending(list(items), desc=f"{ctx.name} items"):
        item = items[key]
        ed = Editor(ctx.model, item)
        oracle, stale = ed.full_prefill(), ed.stale_state()
        states, extra = build(ed)
        cf = ed.content_free_logits()
        rows = state_records(item, oracle, stale, states, m, extra, cf=cf)
        if cot is not None and (cot.cot or cot.cot_only):
            rows = [] if cot.cot_only else rows
            rows += _with_cot(item, ed, oracle, stale, states, cot, m, cf)
        ctx.write(key, rows)


def _edit_states(ed: Editor, cfg: EditConfig) -> list[EditState]:
    builders: dict[str, Callable[[], EditState]] = {
        "field_only": ed.field_only,
        "full_downstream": ed.full_downstream,
        "selective_copy": lambda: ed.selective(ed.rank_by_effect()[: cfg.k], "copy", f"selective_copy@{cfg.k}"),
        "selective_recompute": lambda: ed.selective(ed.rank_by_effect()[: cfg.k], "recompute", f"selective_recompute@{cfg.k}"),
        "selective_recompute_att": lambda: ed.selective(ed.rank_by_attention()[: cfg.k], "recompute", f"selective_recompute_att@{cfg.k}"),
        "erratum": lambda: ed.erratum(cfg.wording, cfg.template),
        "field_erratum": lambda: ed.erratum(cfg.wording, cfg.template, with_field=True),
        "hoist": ed.hoist,
        "cacheblend": lambda: ed.cacheblend(cfg.cacheblend_fraction, cfg.check_layer),
    }
    return [builders[s]() for s in cfg.strategies if s != "stale"]


def summarize_states(records: Sequence[Mapping[str, Any]], group: Sequence[str] = ("strategy",)) -> dict[str, Any]:
    """Per strategy: p_correct (Wilson interval), recovery and recompute_fraction (bootstrap CI),
    time_ratio (mean, median and min-max range over items: one timing each is no sample for a CI)."""
    rows = list(records)
    keys = sorted({tuple(str(r.get(g)) for g in group) for r in rows})
    out: dict[str, Any] = {}
    for key in keys:
        sel = [r for r in rows if tuple(str(r.get(g)) for g in group) == key]
        p_rows = [r for r in sel if r["usable_p_correct"]]
        r_rows = [r for r in sel if r["usable_recovery"]]
        out["/".join(key)] = {
            "p_correct": prop_dict(float(r["correct"]) for r in p_rows),
            "recovery": ci_dict(r["recovery"] for r in r_rows),
            "recompute_fraction": ci_dict(r["recompute_fraction"] for r in sel),
            "time_ratio": range_dict(r["time_ratio"] for r in sel),
        }
    items = {r["item_id"]: r for r in rows}
    return {
        "margin": sorted({r["margin"] for r in rows}),
        "n_items": len(items),
        "n_usable_recovery": sum(bool(r["usable_recovery"]) for r in items.values()),
        "n_usable_p_correct": sum(bool(r["usable_p_correct"]) for r in items.values()),
        "strategies": out,
    }


def summarize(records: Sequence[Mapping[str, Any]], cfg: EditConfig) -> dict[str, Any]:
    return summarize_states(records)


def run(ctx: Context) -> None:
    cfg: EditConfig = ctx.params
    drive(ctx, lambda ed: (_edit_states(ed, cfg), None), cfg.margin, cfg)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "edit"
CONFIG = EditConfig
HELP = "edit strategies: P(correct), recovery, recompute fraction, time vs full re-prefill"
