"""Our number for each claim of the paper, per model (the verdict against the claim's band is
analysis.verdicts).

An extractor per claim recomputes it from the tidy frame of records.parquet (analysis.load): the
mean over items with a 95 % bootstrap CI (Wilson for proportions; analysis.aggregate), n = items
or the unit named in the note. A claim nothing measured yields no rows, never zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd

from analysis.aggregate import (
    CI_COLUMNS,
    ci_table,
    layer_accuracy,
    mean_ci,
    memory_view,
    quantile_ratio_ci,
    serving_view,
    to_float,
    widen_by_cluster,
    write_depth,
)
from analysis.figures.ttft_scaling import headline_seam, speedups, timing
from analysis.load import job_params, select
from kvnotes.measure.margins import STEPS
from kvnotes.measure.metrics import flipped_back, raw_p_correct, wilson_ci

Extractor = Callable[[pd.DataFrame], pd.DataFrame]
COLUMNS = ("model", *CI_COLUMNS, "runs", "note", "zero_eps")
BF16_STEP = STEPS["bfloat16"]  # one bfloat16 step of a score (logit difference): 1/16 logit
PROPORTIONS = frozenset({"correct", "correct_raw", "reverted", "flipped", "agree", "decision_agree", "top1_agree"})


def _rows(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _finish(t: pd.DataFrame, df: pd.DataFrame, note: str = "") -> pd.DataFrame:
    """A ci_table by model plus the runs each model's number came from."""
    runs = df.groupby("model")["run_id"].agg(lambda s: ", ".join(sorted(set(map(str, s)))))
    cluster = t["cluster_note"] if "cluster_note" in t else pd.Series("", index=t.index)
    t = t.assign(runs=t["model"].map(runs), note=["; ".join(x for x in (note, c) if x) for c in cluster])
    if "zero_eps" not in t:
        t = t.assign(zero_eps=math.nan)
    return t[t["n"] > 0][list(COLUMNS)].reset_index(drop=True)


def zero_eps(df: pd.DataFrame, unit: Sequence[str] = ("run_id", "item_id")) -> pd.Series:
    """Per model: one score step of the run's dtype (bfloat16 1/16 logit; an unknown dtype is
    taken as bfloat16) in recovery units, step / |score_oracle - score_stale| per item, averaged
    over items (NaN where the records carry no scores)."""
    if df.empty or not {"score_oracle", "score_stale"} <= set(df.columns):
        return pd.Series(dtype=float)
    denom = (to_float(df["score_oracle"]) - to_float(df["score_stale"])).abs()
    dtype = df["dtype"] if "dtype" in df else pd.Series(None, index=df.index)
    step = dtype.map(lambda d: STEPS.get(str(d).removeprefix("torch."), BF16_STEP)).astype(float)
    keys = ["model", *[u for u in unit if u in df]]
    d = df[keys].assign(_eps=step / denom.where(denom > 0))  # the key columns only: no copy of a wide frame
    per_item = d.groupby(keys, dropna=False)["_eps"].mean()
    return per_item.groupby(level=0).mean()


def records(job: str, tasks: Sequence[str] | None, value: str, unit: Sequence[str] = ("run_id", "item_id"),
            usable: str | None = None, note: str = "", **eq: Any) -> Extractor:
    """Mean of `value` over the rows of `job` (first task of `tasks` per model) where col == v."""
    def f(frame: pd.DataFrame) -> pd.DataFrame:
        df = select(frame, job, tasks)
        for col, v in eq.items():
            df = df[df[col] == v] if col in df else df.iloc[:0]
        if usable is not None and len(df):
            df = df[to_float(df[usable]) > 0]
        if "cot" in df and eq.get("cot") is None:
            df = df[~(to_float(df["cot"]) > 0)]
        if df.empty or value not in df:
            return _rows([])
        t = ci_table(df, value, ["model"], unit, proportion=value in PROPORTIONS)
        t = widen_by_cluster(t, df, value, unit)
        if value == "recovery":
            t = t.assign(zero_eps=t["model"].map(zero_eps(df, unit)))
        return _finish(t, df, note)
    return f


def knockout_flips(band_name: str) -> Extractor:
    """Share of items whose decision goes back to the old answer when the band's top keys are
    masked (kvnotes.measure.metrics.flipped_back, the raw pairwise decision): a decision, not a
    window of the signed reversion, which is two-peaked (probe knockout's FLIP_RULE)."""
    inner = records("knockout", ["gated"], "flipped", condition="band", band=band_name,
                    note="n = items whose old and new prompts decide differently (raw decision)")

    def f(frame: pd.DataFrame) -> pd.DataFrame:
        k = frame[(frame["job"] == "knockout") & (frame["condition"] == "band")] if "condition" in frame else frame.iloc[:0]
        if k.empty or not {"score", "score_stale", "score_oracle"} <= set(k.columns):
            return _rows([])
        cols = [to_float(k[c]).to_numpy() for c in ("score", "score_stale", "score_oracle")]
        return inner(k.assign(flipped=flipped_back(*cols)))
    return f


def p_correct(job: str, strategy: str, **eq: Any) -> Extractor:
    """P(correct) of `strategy` over the items usable calibrated (decisions against the content-free
    prompt, the runs' own reading), with the uncalibrated P(correct) in the note: the raw argmax
    over the items usable uncalibrated (kvnotes.measure.metrics.raw_p_correct, the rule the edit
    summaries' p_correct_raw uses). A second reading beside the first, not a second verdict."""
    cal = records(job, ["gated"], "correct", usable="usable_p_correct", strategy=strategy, **eq)
    raw = records(job, ["gated"], "correct_raw", usable="usable_p_correct_raw", strategy=strategy, **eq)
    needs = {"score", "score_stale", "score_oracle", "usable_recovery"}

    def f(frame: pd.DataFrame) -> pd.DataFrame:
        out = cal(frame)
        d = frame[frame["job"] == job]
        if out.empty or not needs <= set(d.columns):
            return out
        usable, correct = raw_p_correct(*(to_float(d[c]) for c in ("score", "score_stale", "score_oracle")),
                                        to_float(d["usable_recovery"]) > 0)
        r = raw(d.assign(usable_p_correct_raw=usable, correct_raw=correct)).set_index("model")
        notes = []
        for m, note in zip(out["model"], out["note"], strict=True):
            x = r.loc[m] if m in r.index else None
            s = ("uncalibrated (raw argmax): no item usable" if x is None else
                 f"uncalibrated (raw argmax): {x['mean']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}], "
                 f"n = {int(x['n'])} items usable uncalibrated")
            notes.append("; ".join(p for p in (note, s) if p))
        return out.assign(note=notes)
    return f


def _linear(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame, float, tuple[float, float, float]]]:
    out = []
    df = select(frame, "linear", ["gated-polarity"])
    for m, d in df.groupby("model"):
        run = str(d["run_id"].iloc[0])
        thr = float(job_params(frame, run).get("threshold", 0.9))
        acc = layer_accuracy(d[(d["condition"] == "layer") & (d["run_id"] == run)])
        out.append((str(m), d, thr, write_depth(acc, thr)))
    return out


def write_depth_claim(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for m, d, thr, (w, w_lo, w_hi) in _linear(frame):
        n = int(to_float(d.loc[d["condition"] == "layer", "n_prompts"]).max())
        note = f"threshold {thr:g}; interval: layers whose Wilson CI first reaches it"
        if math.isnan(w):
            note = f"accuracy never reaches {thr:g}: no write depth"
        rows.append({"model": m, "mean": w, "lo": w_lo, "hi": w_hi, "n": n, "runs": d["run_id"].iloc[0], "note": note})
    return _rows(rows)


def write_before_commit(frame: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for m, d, _, (w, w_lo, w_hi) in _linear(frame):
        c = ci_table(d[d["condition"] == "prompt"], "rel_commit", ["model"], ("run_id", "item_id", "prompt"))
        if c.empty or math.isnan(w):
            continue
        r = c.iloc[0]
        rows.append({"model": m, "mean": r["mean"] - w, "lo": r["lo"] - (w_hi if not math.isnan(w_hi) else w),
                     "hi": r["hi"] - (w_lo if not math.isnan(w_lo) else w), "n": r["n"], "runs": d["run_id"].iloc[0],
                     "note": "interval combines the commit CI and the write-depth interval"})
    return _rows(rows)


def _compose_or_selfcheck(frame: pd.DataFrame, seam: int, value: str = "cosine") -> pd.DataFrame:
    comp = frame[(frame["job"] == "compose")] if "job" in frame else frame.iloc[:0]
    comp = comp[(comp["kind"] == "fidelity") & (comp["seam"] == seam)] if "kind" in comp else comp.iloc[:0]
    prop = value in PROPORTIONS
    out = [_finish(ci_table(comp, value, ["model"], proportion=prop), comp, "experiment compose")] if len(comp) else []
    sc = frame[(frame["job"] == "selfcheck")] if "job" in frame else frame.iloc[:0]
    sc = sc[(sc["seam"] == seam) & ~sc["model"].isin(set(comp["model"]))] if len(sc) and value in sc else sc.iloc[:0]
    if len(sc):
        out.append(_finish(ci_table(sc, value, ["model"], ("run_id", "block"), proportion=prop), sc,
                           "selfcheck gate blocks (no compose run for this model)"))
    return pd.concat(out, ignore_index=True) if out else _rows([])


def seam_cosine(seam: int) -> Extractor:
    return lambda frame: _compose_or_selfcheck(frame, seam)


def seam_gain(frame: pd.DataFrame) -> pd.DataFrame:
    comp = frame[(frame["job"] == "compose")] if "job" in frame else frame.iloc[:0]
    comp = comp[comp["kind"] == "fidelity"] if "kind" in comp else comp.iloc[:0]
    rows = []
    for m, d in comp.groupby("model"):
        p = d.pivot_table(index=["run_id", "item_id"], columns="seam", values="cosine", aggfunc="mean")
        if 0 in p and 4 in p:
            mean, lo, hi, n = mean_ci((p[4] - p[0]).to_numpy())
            rows.append({"model": m, "mean": mean, "lo": lo, "hi": hi, "n": n,
                         "runs": ", ".join(sorted(set(d["run_id"]))), "note": "paired per item"})
    return _rows(rows)


def compose_accuracy(frame: pd.DataFrame) -> pd.DataFrame:
    """Decision accuracy of composed prompts at K = 4, with the full prefill's own accuracy beside."""
    out = _compose_or_selfcheck(frame, 4, "correct")
    if out.empty:
        return out
    comp = frame[(frame["job"] == "compose") & (frame["kind"] == "fidelity") & (frame["seam"] == 4)]
    for i, r in out.iterrows():
        d = comp[comp["model"] == r["model"]]
        full = ci_table(d, "correct_ref", ["model"])
        agree = ci_table(d, "decision_agree", ["model"])
        if len(full) and len(agree):
            out.loc[i, "note"] = (f"{r['note']}; full prefill accuracy {full['mean'].iloc[0]:.3f}, decision "
                                  f"agreement with it {agree['mean'].iloc[0]:.3f}")
    return out


def ttft_speedup(length: int) -> Extractor:
    def f(frame: pd.DataFrame) -> pd.DataFrame:

        t = timing(frame)
        rows = []
        for m, d in t.groupby("model"):
            near = [n for n in sorted(d["length"].unique()) if abs(n - length) <= 0.1 * length]
            if not near:
                continue
            seam = headline_seam(frame, str(d["run_id"].iloc[0]), d)
            sp = speedups(d[d["length"] == near[0]], seam)
            r = sp[sp["path"] == "transplant"].iloc[0]
            dev = d["device_record"].iloc[0] if "device_record" in d else d["device"].iloc[0]
            rows.append({"model": m, "mean": r["mean"], "lo": r["lo"], "hi": r["hi"], "n": r["n"],
                         "runs": d["run_id"].iloc[0],
                         "note": f"{int(near[0])} tokens, seam {seam}, {dev}; n = repeats; "
                                 "interval: min-max over the repeats, not a CI"})
        return _rows(rows)
    return f


def _agent(value: str) -> Extractor:
    def f(frame: pd.DataFrame) -> pd.DataFrame:
        t = frame[frame["job"] == "agent"] if "job" in frame else frame.iloc[:0]
        t = t[t["kind"] == "turn"] if "kind" in t else t.iloc[:0]
        if t.empty:
            return _rows([])
        return _finish(ci_table(t, value, ["model"], ("run_id", "scenario"), proportion=value in PROPORTIONS), t,
                       "n = scenarios (turns averaged)")
    return f


def _serving_hit(arm: str) -> Extractor:
    def f(frame: pd.DataFrame) -> pd.DataFrame:
        v, why = serving_view(frame)
        v = v[v["arm"] == arm] if not why else v
        if why or v.empty or v["hit"].isna().all():
            return _rows([])
        per_phase = v.drop_duplicates(["run_id", "phase_label"])
        if per_phase[["hit_tokens", "query_tokens"]].notna().all().all():
            return _finish(_hit_blocks(frame, per_phase), per_phase,
                           "pooled over the load phases (sequential, each rate); Wilson over the cache "
                           "blocks queried (vLLM hits whole blocks), n = blocks")
        return _finish(ci_table(per_phase, "hit", ["model"], ("run_id", "phase_label")), per_phase,
                       "n = phases (sequential, each rate); each a prefix-cache counter ratio")
    return f


def _hit_blocks(frame: pd.DataFrame, per_phase: pd.DataFrame) -> pd.DataFrame:
    """Per model: hit tokens / queried tokens pooled over the phases, with a Wilson interval over
    cache blocks (each run's experiment.block_size, 32 by default): vLLM's prefix cache hits whole
    blocks, so a block, not a token, is the smallest unit that can hit or miss."""
    rows = []
    for m, d in per_phase.groupby("model"):
        hit = query = 0.0
        for run, r in d.groupby("run_id"):
            block = float(job_params(frame, str(run)).get("block_size") or 32)
            hit += float(r["hit_tokens"].sum()) / block
            query += float(r["query_tokens"].sum()) / block
        n = int(round(query))
        k = min(int(round(hit)), n)
        _, lo, hi = wilson_ci(k, n) if n else (math.nan, math.nan, math.nan)
        rows.append({"model": m, "mean": hit / query if query else math.nan, "lo": lo, "hi": hi, "n": n})
    return pd.DataFrame(rows, columns=["model", "mean", "lo", "hi", "n"])


def serving_p90(frame: pd.DataFrame) -> pd.DataFrame:
    v, why = serving_view(frame)
    rows: list[dict[str, Any]] = []
    if why:
        return _rows(rows)
    for (m, phase), d in v.groupby(["model", "phase_label"]):
        a, b = d[d["arm"] == "edit"], d[d["arm"] == "erratum"]
        if len(a) and len(b):
            mean, lo, hi, n = quantile_ratio_ci(a["ttft_ms"], b["ttft_ms"])
            cens = [f"{arm} {int(x['censored'].sum())} of {len(x)}" for arm, x in (("edit", a), ("erratum", b))
                    if x["censored"].any()]
            note = f"{phase}; n = requests of the smaller arm"
            if cens:
                note += "; censored at the phase cap (TTFT lower bounds): " + ", ".join(cens)
            rows.append({"model": m, "mean": mean, "lo": lo, "hi": hi, "n": n,
                         "runs": ", ".join(sorted(set(d["run_id"]))), "note": note})
    return _rows(rows)


def _memory(value: str) -> Extractor:
    def f(frame: pd.DataFrame) -> pd.DataFrame:
        v, why = memory_view(frame)
        if why:
            return _rows([])
        t = ci_table(v, value, ["model"], ("run_id", "unit"))
        if "conversation" in v:  # LoCoMo: questions of one conversation share its memory block
            t = widen_by_cluster(t, v, value, ("run_id", "unit"), "conversation")
        return _finish(t, v, str(v["source"].iloc[0]))
    return f


EXTRACTORS: dict[str, Extractor] = {
    "field_only_recovery": records("patching", ["gated"], "recovery", condition="field_only"),
    "full_downstream_recovery": records("patching", ["gated"], "recovery", condition="full_downstream"),
    "notes_only_recovery": records("patching", ["gated"], "recovery", condition="notes_only"),
    "trigger_only_recovery": records("patching", ["gated-trigger"], "recovery", condition="field_only"),
    "trigger_notes_recovery": records("patching", ["gated-trigger"], "recovery", condition="notes_only"),
    "suffix_k20": records("suffix", ["gated"], "recovery", condition="suffix", k=20),
    "prefix_k70": records("suffix", ["gated"], "recovery", condition="prefix", k=70),
    "top8_recovery": records("suffix", ["gated"], "recovery", condition="topk", k=8),
    "random8_recovery": records("suffix", ["gated"], "recovery", condition="randomk", k=8),
    "write_depth": write_depth_claim,
    "commit_depth": records("linear", ["gated-polarity"], "rel_commit", ("run_id", "item_id", "prompt"),
                            note="n = prompts", condition="prompt"),
    "write_before_commit": write_before_commit,
    **{f"knockout_{b}": knockout_flips(b) for b in ("early", "mid", "late", "all")},
    **{f"mass_{k}": records("knockout", ["gated"], f"mass_{k}", condition="mass")
       for k in ("field", "downstream", "sink")},
    "heads_top_recovery": records("knockout", ["gated"], "recovery", condition="heads",
                                  ranking="attention", n_heads=12),
    "heads_random_recovery": records("knockout", ["gated"], "recovery", condition="heads",
                                     ranking="random", n_heads=12),
    "causal_scrubbing_note": records("scrub", ["gated"], "recovery", condition="note", notes="aggregators"),
    "causal_scrubbing_rest": records("scrub", ["gated"], "recovery", condition="rest", notes="aggregators"),
    "causal_scrubbing_note_attended": records("scrub", ["gated"], "recovery", condition="note", notes="attended"),
    "causal_scrubbing_rest_attended": records("scrub", ["gated"], "recovery", condition="rest", notes="attended"),
    "split_facts_agreement_split": records("split", ["gated"], "agree", ("run_id", "item_id", "prompt"),
                                           note="n = prompts", condition="split", seam=0),
    "split_facts_agreement_single": records("split", ["gated"], "agree", ("run_id", "item_id", "prompt"),
                                            note="n = prompts", condition="single", seam=0),
    "erratum_p_correct": p_correct("edit", "erratum"),
    "field_only_p_correct": p_correct("edit", "field_only"),
    "field_only_cot_p_correct": p_correct("edit", "field_only+cot", cot=True),
    "wording_bare": p_correct("wording", "erratum_bare"),
    "wording_tagged": p_correct("wording", "erratum_tagged"),
    "wording_explicit": p_correct("wording", "erratum"),
    "wording_reevaluate": p_correct("wording", "erratum_reevaluate"),
    **{f"seam_cosine_k{k}": seam_cosine(k) for k in (0, 2, 4, 32)},
    "seam_repair_gain": seam_gain,
    "fidelity_cosine": seam_cosine(4),
    "compose_accuracy": compose_accuracy,
    **{f"ttft_speedup_{n}": ttft_speedup(n) for n in (500, 2000, 8000, 16000, 32000)},
    "agent_agreement": _agent("agree"),
    "agent_latency_ratio": _agent("latency_ratio"),
    "memory_delta": _memory("delta"),
    "memory_cosine": _memory("cosine"),
    "serving_hit_rate_erratum": _serving_hit("erratum"),
    "serving_hit_rate_inplace": _serving_hit("edit"),
    "serving_p90_ratio": serving_p90,
}


def ours(frame: pd.DataFrame, claim: str) -> pd.DataFrame:
    """Our value of `claim` per model (no rows: nothing measured it in these runs)."""
    f = EXTRACTORS.get(claim)
    if f is None or frame.empty or "job" not in frame:
        return _rows([])
    out = f(frame)
    return out.assign(n=out["n"].astype(int)) if len(out) else out


def all_claims(frame: pd.DataFrame, claims: Sequence[str]) -> pd.DataFrame:
    """Long table: claim, model, mean, lo, hi, n, runs, note."""
    parts = [ours(frame, c).assign(claim=c) for c in claims]
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=["claim", *COLUMNS])
    return pd.concat(parts, ignore_index=True)[["claim", *COLUMNS]]


# --- verdicts -----------------------------------------------------------------------------------
