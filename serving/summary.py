"""Summary of the serving benchmark (experiment `serving`): per variant and phase the prefix-cache
hit rate and TTFT quantiles, edit/variant TTFT ratios, and the decisions over items with
Wilson intervals (kvnotes.measure.metrics.prop_dict).

Every number names what it measures. hit_rate: hit / queried prompt tokens from vLLM's
counters (token-weighted over the requests of that variant and phase). ttft_*: client time to
first token, quantiles over requests; a request cancelled at the phase cap counts at its lower
bound (cap - arrival), so a quantile over censored requests, and a ratio against it, is a lower
bound. p_correct: the share of items whose served decision is the one the requested field value
requires (Wilson 95 %), n = items with a completed request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvnotes.measure.metrics import prop_dict
from serving.prompts import VALUES, VARIANTS

Row = Mapping[str, Any]
MEASURES = {  # summary.json carries this: what each number of results / ratios / decisions is
    "hit_rate": "prefix-cache hit tokens / queried prompt tokens, vLLM's counters, over the phase's requests",
    "ttft_p50_s / ttft_p90_s / ttft_p99_s": "client time to first streamed token (s), quantile over "
    "requests; censored requests at their lower bound (cap - arrival), then marked ttft_is_lower_bound",
    "throughput": "completed requests per second of the phase (to the last completion, or to the cap)",
    "offered_load": "rate x S: the in-prefix edit's utilization at this rate (S = edit_service_s)",
    "n_censored / n_unsent": "requests cancelled at the overload cap / scheduled after it and not sent",
    "n_repeat, ttft_p50_repeat_s, hit_rate_repeat": "requests whose exact prompt this server had "
    "already been sent (edit_field once both values were seen), their median TTFT and hit rate",
    "decision_agreement": "share of requests whose decision equals the in-prefix edit's on the same "
    "request (same index; items: same item and value)",
    "p_correct": "share of requests whose decision is the one the requested field value requires",
    "ratios.*_ratio": "edit / variant TTFT quantile; a lower bound where ratio_is_lower_bound",
    "decisions.p_correct.<variant>.<value>": "P(correct) over items, Wilson 95 %; live = unchanged context",
    "edit_service_s": "median latency (s) of the edit's sequential requests: its service time S",
}
ORDER = ("items", "sequential")  # then the sustained rates (ascending), then overload


def _q(values: Sequence[float], q: float) -> float:
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    return float(np.percentile(v, q)) if v.size else math.nan


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def label_of(r: Row) -> str:
    """The phase a request belongs to: items, sequential, the Poisson rate (`g`), or overload."""
    return f"{_f(r['rate']):g}" if r["phase"] == "poisson" else str(r["phase"])


def _pair(r: Row) -> tuple[Any, ...]:
    """Requests compared across variants: same item and value (items), same index (load)."""
    return (r.get("item_index"), r["value"]) if r["phase"] == "items" else (r.get("item_index"), r["index"])


def _token_hit(rows: Sequence[Row]) -> float:
    """Sum of request-level hit tokens / queried tokens (NaN unless every row has them)."""
    h, q = [_f(r.get("hit_tokens")) for r in rows], [_f(r.get("query_tokens")) for r in rows]
    if not rows or any(math.isnan(x) for x in h + q) or sum(q) <= 0:
        return math.nan
    return sum(h) / sum(q)


def stats(rows: Sequence[Row], edit: Sequence[Row]) -> dict[str, Any]:
    """One variant in one phase (rows sorted by index); `edit`: the edit's rows of that phase."""
    ok = [r for r in rows if r["status"] == "ok"]
    lower = [_f(r["ttft_lower_s"]) for r in rows]
    censored = sum(r["status"] == "cancelled" for r in rows)
    ends = [_f(r["end_s"]) for r in ok]
    span = max(ends) if not censored and ends else _f(rows[0]["wall_s"])
    by_pair = {_pair(r): r["decision"] for r in edit if r["status"] == "ok"}
    pairs = [(r["decision"], by_pair[_pair(r)]) for r in ok if _pair(r) in by_pair]
    repeat = [r for r in rows if not bool(r.get("first_seen", True))]
    first = rows[0]
    hit = _token_hit(rows)
    return {
        "rate": _f(first["rate"]), "offered_load": _f(first.get("offered_load")),
        "driver": str(first.get("driver", "client")),
        "n": len(rows), "n_ok": len(ok), "n_censored": censored,
        "n_error": sum(r["status"] == "error" for r in rows),
        "n_unsent": int(_f(first.get("n_planned", len(rows)))) - len(rows) if first["phase"] != "items" else 0,
        "prompt_tokens": _q([_f(r["prompt_tokens"]) for r in ok], 50),
        "hit_rate": hit if not math.isnan(hit) else _f(first.get("phase_hit_rate")),
        "ttft_p50_s": _q(lower, 50), "ttft_p90_s": _q(lower, 90), "ttft_p99_s": _q(lower, 99),
        "ttft_is_lower_bound": bool(censored),
        "latency_p50_s": _q([_f(r["latency_s"]) for r in ok], 50),
        # completed requests / s of the phase (items: one timeline per item, so none)
        "throughput": len(ok) / span if span > 0 and first["phase"] != "items" else math.nan,
        "server_ttft_mean_s": _f(first.get("phase_server_ttft_mean_s")),
        "server_ttft_p90_s": _f(first.get("phase_server_ttft_p90_s")),
        # requests whose exact prompt this server had been sent before (edit_field, once both
        # values have been seen): their TTFT and request-level hit rate
        "n_repeat": len(repeat), "ttft_p50_repeat_s": _q([_f(r["ttft_lower_s"]) for r in repeat], 50),
        "hit_rate_repeat": _token_hit(repeat),
        "decision_agreement": (sum(a == b for a, b in pairs) / len(pairs)) if pairs else math.nan,
        "n_agreement": len(pairs),
        "p_correct": (sum(bool(r["correct"]) for r in ok) / len(ok)) if ok else math.nan,
        "decisions": {w: sorted({r["decision"] for r in ok if r["value"] == w}) for w in VALUES},
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(a) else math.nan


def _sort_key(label: str) -> tuple[int, float]:
    if label in ORDER:
        return (ORDER.index(label), 0.0)
    return (3, 0.0) if label == "overload" else (2, float(label))


def decisions(rows: Sequence[Row]) -> dict[str, Any]:
    """P(correct) per variant and field value over the items phase, Wilson 95 %, and agreement
    with the in-prefix edit on the same item and value; `live` is the unchanged context (old)."""
    items = [r for r in rows if r["phase"] == "items" and r["status"] == "ok"]
    if not items:
        return {}
    out: dict[str, Any] = {"p_correct": {}, "agreement_with_edit": {}}
    edit = {(r["item_index"], r["value"]): r["decision"] for r in items if r["variant"] == "edit"}
    for v in ("live", *VARIANTS):
        for w in VALUES:
            rs = sorted((r for r in items if r["variant"] == v and r["value"] == w), key=lambda r: r["item_index"])
            if not rs:
                continue
            out["p_correct"].setdefault(v, {})[w] = prop_dict([bool(r["correct"]) for r in rs])
            paired = [r["decision"] == edit[(r["item_index"], w)] for r in rs if (r["item_index"], w) in edit]
            if v != "edit" and paired:
                out["agreement_with_edit"].setdefault(v, {})[w] = prop_dict(paired)
    live = {r["item_index"]: bool(r["correct"]) for r in items if r["variant"] == "live"}
    follows = [live[i] and bool(r["correct"]) for (i, w), r in
               {(r["item_index"], r["value"]): r for r in items if r["variant"] == "edit"}.items()
               if w == "new" and i in live]
    if follows:  # the in-prefix decision is right for both values of the same item
        out["follows_field"] = prop_dict(follows)
    err = {(r["item_index"], r["value"]): bool(r["correct"]) for r in items if r["variant"] == "erratum"}
    obeyed = [err[(i, "new")] and err[(i, "old")] for i in sorted({i for i, _ in err})
              if (i, "new") in err and (i, "old") in err]
    if obeyed:  # the decision is right for the value the erratum states, both values of the same item
        out["follows_erratum"] = prop_dict(obeyed)
    out["n_items"] = len({r["item_index"] for r in items})
    return out


def field_sensitive(rows: Sequence[Row], dec: Mapping[str, Any]) -> bool:
    """Whether the model's decision follows the field at all. Over items: the in-prefix edit's
    P(correct) with the new value and the unchanged context's, both above 0.5 (Wilson lower
    bound). Without an items phase: the edit's decisions differ between the two values."""
    pc = dec.get("p_correct", {})
    if "edit" in pc and "new" in pc["edit"] and "live" in pc:
        return bool(pc["edit"]["new"]["ci_lo"] > 0.5 and pc["live"]["old"]["ci_lo"] > 0.5)
    ok = [r for r in rows if r["variant"] == "edit" and r["status"] == "ok"]
    by = {w: {r["decision"] for r in ok if r["value"] == w} for w in VALUES}
    return bool(by["new"] and by["old"] and by["new"] != by["old"])


def reading(model: str, sensitive: bool, dec: Mapping[str, Any]) -> str:
    """One sentence for the run's printout: whether the model follows the field, with numbers."""
    pc = dec.get("p_correct", {})

    def cell(v: str, w: str) -> str:
        d = pc.get(v, {}).get(w)
        return "n/a" if d is None else f"{d['mean']:.2f} [{d['ci_lo']:.2f}, {d['ci_hi']:.2f}] (n={d['n']})"

    obeyed = dec.get("follows_erratum")
    if sensitive:
        first = f"{model} follows the field (field_sensitive true), so P(correct) under the erratum tests that it is obeyed"
    elif obeyed is not None and obeyed["ci_lo"] > 0.5:  # the field_sensitive rule, applied to the erratum
        first = (f"{model} does not follow the field in the prefix reliably (field_sensitive false), but its decision "
                 f"follows the value the erratum states (right for both values of an item: "
                 f"{obeyed['k']}/{obeyed['n']}, Wilson [{obeyed['ci_lo']:.2f}, {obeyed['ci_hi']:.2f}]): the erratum is "
                 "obeyed")
    else:
        first = (f"{model} does not follow the field (field_sensitive false): the decisions show the cache "
                 "mechanism only, not that an erratum is obeyed")
    if not pc:
        return first + " (judged on the load phases' requests: no items phase)."
    return (f"{first}. P(correct) of the served decision, Wilson 95 %, n = items: in-prefix edit with the new "
            f"value {cell('edit', 'new')}, unchanged context {cell('live', 'old')}; erratum with the new value "
            f"{cell('erratum', 'new')}, erratum restating the old value {cell('erratum', 'old')}.")


def service_time(rows: Sequence[Row]) -> float:
    """Median latency (s) of the in-prefix edit's completed sequential requests: the time one
    edit keeps the server busy, from which the sustained and overload rates are derived."""
    return _q([_f(r["latency_s"]) for r in rows if r["phase"] == "sequential" and r["variant"] == "edit"
               and r["status"] == "ok"], 50)


def summarize(records: Sequence[Row], length: int, block_size: int, model: str = "the model") -> dict[str, Any]:
    """Per variant and phase (items, sequential, each sustained rate, overload): the stats; per
    phase: edit/variant TTFT ratios (lower bounds where anything was censored); the decisions."""
    rows = [r for r in records if r["variant"] != "live"]
    phases: dict[str, dict[str, list[Row]]] = {}
    for r in rows:
        phases.setdefault(label_of(r), {}).setdefault(r["variant"], []).append(r)
    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, dict[str, Any]]] = {}
    for label in sorted(phases, key=_sort_key):
        by_v = phases[label]
        edit = by_v.get("edit", [])
        for v, rs in by_v.items():
            results.setdefault(v, {})[label] = stats(sorted(rs, key=lambda r: (_f(r.get("item_index")), r["index"])), edit)
        if "edit" not in by_v:
            continue
        e = results["edit"][label]
        for v in by_v:
            if v == "edit":
                continue
            s = results[v][label]
            ratios.setdefault(v, {})[label] = {
                "p50_ratio": _ratio(e["ttft_p50_s"], s["ttft_p50_s"]),
                "p90_ratio": _ratio(e["ttft_p90_s"], s["ttft_p90_s"]),
                "p99_ratio": _ratio(e["ttft_p99_s"], s["ttft_p99_s"]),
                "throughput_ratio": _ratio(s["throughput"], e["throughput"]),
                # censored edit requests make its quantiles, so the ratio, a lower bound;
                # censored on both sides the ratio is bounded on neither side
                "ratio_is_lower_bound": bool(e["ttft_is_lower_bound"]) and not s["ttft_is_lower_bound"],
                "ratio_undetermined": bool(s["ttft_is_lower_bound"]),
            }
    dec = decisions(records)
    sensitive = field_sensitive(rows, dec)
    return {
        "item_id": rows[0]["item_id"] if rows else None, "length": length, "block_size": block_size,
        "field_sensitive": sensitive, "reading": reading(model, sensitive, dec),
        "startup_s": _q([_f(r["startup_s"]) for r in rows], 50),
        "served_dtype": next((str(r["served_dtype"]) for r in rows if r.get("served_dtype")), None),
        "edit_service_s": service_time(rows),
        "decisions": dec, "results": results, "ratios": ratios, "measures": MEASURES,
        "p90_ratio": {k: v["p90_ratio"] for k, v in ratios.get("erratum", {}).items()},
        "table": table(results, ratios),
    }


def table(results: Mapping[str, Mapping[str, Mapping[str, Any]]],
          ratios: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """Markdown lines: one row per variant and phase, then the edit/variant TTFT ratios."""
    head = ("| variant | phase | rate (req/s) | n (ok/censored) | prompt tokens | hit rate | TTFT p50 s "
            "| p90 s | p99 s | throughput req/s | agreement with edit | P(correct) |")
    out = [head, "|" + "---|" * head.count(" | ") + "---|"]
    labels = sorted({lab for v in results.values() for lab in v}, key=_sort_key)
    for lab in labels:
        for v in VARIANTS:
            s = results.get(v, {}).get(lab)
            if s is None:
                continue
            lb = "≥" if s["ttft_is_lower_bound"] else ""
            phase = lab if not lab[0].isdigit() else "poisson"
            out.append(f"| {v} | {phase} | {s['rate']:.3g} | {s['n']} ({s['n_ok']}/{s['n_censored']}) | "
                       f"{s['prompt_tokens']:.0f} | {s['hit_rate']:.3f} | {lb}{s['ttft_p50_s']:.3f} | "
                       f"{lb}{s['ttft_p90_s']:.3f} | {lb}{s['ttft_p99_s']:.3f} | {s['throughput']:.3f} | "
                       f"{s['decision_agreement']:.2f} | {s['p_correct']:.2f} |")
    for v, by in ratios.items():
        for lab in labels:
            if lab in by:
                r, lb = by[lab], "≥" if by[lab]["ratio_is_lower_bound"] else ""
                note = " (lower bounds: edit requests censored at the cap)" if lb else ""
                if r["ratio_undetermined"]:
                    lb, note = "~", f" (undetermined: {v} requests censored too)"
                out.append(f"edit/{v} TTFT at {lab}: p50 {lb}{r['p50_ratio']:.1f}x, p90 {lb}{r['p90_ratio']:.1f}x, "
                           f"p99 {lb}{r['p99_ratio']:.1f}x; throughput {v}/edit {r['throughput_ratio']:.1f}x{note}")
    return out
