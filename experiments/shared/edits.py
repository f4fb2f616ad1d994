"""The edit experiments' driver and records (edit, ksweep, wording): per item, the stale and
oracle states timed side by side, then the strategies' states, each read as P(correct),
recovery, recompute fraction and time ratio; and their summary per strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvnotes.edit.strategies import Editor, EditState
from kvnotes.measure import margins
from kvnotes.measure.metrics import ci_dict, prop_dict, range_dict, raw_p_correct, recovery
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.scoring import decide, outcome_logits, score

if TYPE_CHECKING:
    from experiments.shared.context import Context


class CotOptions(Protocol):
    """What the driver reads of a chain-of-thought setting (experiments.edit.EditConfig has it)."""

    cot: bool
    cot_only: bool
    cot_tokens: int
    cot_strategies: list[str]


def _pick(item: TaskItem, logits: Any, cf: Any = None) -> str:
    """The chosen outcome; calibrated against the content-free logits `cf` when given."""
    return item.outcomes[decide(outcome_logits(item, logits), None if cf is None else outcome_logits(item, cf))]


def state_records(item: TaskItem, oracle: EditState, stale: EditState, states: Sequence[EditState],
                  margin: float, extra: Sequence[Mapping[str, Any]] | None = None,
                  cf: Any = None) -> list[dict[str, Any]]:
    """One record per state with P(correct), recovery, cost; usability flags of the item.

    `cf`: the content-free prompt's decision logits; when given, every pick is calibrated by them.
    """
    s_old, s_new = score(item, stale.logits), score(item, oracle.logits)
    usable_rec = margins.unusable(s_new - s_old, margin) is None
    old_pick, new_pick = _pick(item, stale.logits, cf), _pick(item, oracle.logits, cf)
    usable_p = usable_rec and old_pick == item.correct_old and new_pick == item.correct_new
    out = []
    for i, st in enumerate([stale, oracle, *states]):
        s, pick = score(item, st.logits), _pick(item, st.logits, cf)
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
    return float(ctx.model.margin if margin is None else margin)


def _with_cot(item: TaskItem, ed: Editor, oracle: EditState, stale: EditState, states: list[EditState],
              cfg: CotOptions, margin: float, cf: Any = None) -> list[dict[str, Any]]:
    """Records of the CoT reads: each state, stale and oracle all decided after a reasoning."""
    def cot(st: EditState) -> EditState:
        logits, _ = ed.cot(st, cfg.cot_tokens)
        return dataclasses.replace(st, strategy=f"{st.strategy}+cot", logits=logits)

    chosen = [st for st in states if st.strategy.split("@")[0] in cfg.cot_strategies]
    rows = state_records(item, cot(oracle), cot(stale), [cot(st) for st in chosen], margin, cf=cf)
    return [r | {"cot": True} for r in rows]


def drive(ctx: Context, build: Callable[[Editor], tuple[list[EditState], list[dict[str, Any]] | None]],
           margin: float | None, cot: CotOptions | None = None) -> None:
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


def _raw(rows: Sequence[Mapping[str, Any]]) -> list[tuple[bool, bool]]:
    """(usable, correct) of each record's uncalibrated P(correct), in one vectorised call
    (kvnotes.measure.metrics.raw_p_correct); records without scores are usable for neither reading."""
    if not rows:
        return []
    nan = float("nan")
    score, stale, oracle = ([r.get(k, nan) for r in rows] for k in ("score", "score_stale", "score_oracle"))
    usable, correct = raw_p_correct(score, stale, oracle, [bool(r["usable_recovery"]) for r in rows])
    return list(zip(usable.tolist(), correct.tolist(), strict=True))


def summarize_states(records: Sequence[Mapping[str, Any]], group: Sequence[str] = ("strategy",)) -> dict[str, Any]:
    """Per strategy: p_correct (Wilson interval) over the items usable calibrated (picks against the
    content-free prompt) and p_correct_raw over the items usable uncalibrated (raw argmax), recovery
    and recompute_fraction (bootstrap CI), time_ratio (mean, median and min-max range over items:
    one timing each is no sample for a CI)."""
    rows = list(records)
    raw_of = dict(zip(map(id, rows), _raw(rows), strict=True))  # once per record
    keys = sorted({tuple(str(r.get(g)) for g in group) for r in rows})
    out: dict[str, Any] = {}
    for key in keys:
        sel = [r for r in rows if tuple(str(r.get(g)) for g in group) == key]
        p_rows = [r for r in sel if r["usable_p_correct"]]
        raw = [raw_of[id(r)] for r in sel]
        r_rows = [r for r in sel if r["usable_recovery"]]
        out["/".join(key)] = {
            "p_correct": prop_dict(float(r["correct"]) for r in p_rows),
            "p_correct_raw": prop_dict(float(correct) for usable, correct in raw if usable),
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
        "n_usable_p_correct_raw": sum(raw_of[id(r)][0] for r in items.values()),
        "strategies": out,
    }
