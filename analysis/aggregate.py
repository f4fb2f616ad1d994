"""Means with 95 % bootstrap confidence intervals, grouped, from the tidy records frame.

Rows are first averaged within their unit (an item of a run: random draws, repeated conditions),
then the mean over units gets a percentile bootstrap CI, so n always counts units, never rows.
The bootstrap is kvnotes.measure.metrics.bootstrap_ci (scipy.stats.bootstrap, seeded): the same code and
defaults that write summary.json, so a report CI and a summary CI of the same values agree.
NaN stays out of the mean and out of n (a skipped item is not a zero). Proportions (one 0/1
outcome per unit: P(correct), reverted, agreement) get a Wilson interval (kvnotes.measure.metrics.wilson_ci),
never a zero-width bootstrap one; so do accuracies that come as one cross-validated number per
layer. Items that share a domain (or a LoCoMo conversation) are not independent: `widen_by_cluster`
sets beside each interval a cluster bootstrap (kvnotes.measure.metrics.cluster_bootstrap_ci, whole
clusters resampled) and keeps the wider of the two. The paper's reference numbers live in
paper_reference.yaml, read here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from kvnotes.measure.metrics import bootstrap_ci, cluster_bootstrap_ci, wilson_ci
from kvnotes.models.registry import get_spec

UNIT = ("run_id", "item_id")  # one item of one run
REFERENCE = Path(__file__).with_name("paper_reference.yaml")
CI_COLUMNS = ("mean", "lo", "hi", "n")


def mean_ci(values: Any, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of the finite values: kvnotes.measure.metrics.bootstrap_ci on numbers coerced
    from anything (booleans, None). n = 0 gives all NaN; n = 1 a NaN interval; identical values a
    zero-width one."""
    x = np.asarray(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce"), dtype=float)
    return bootstrap_ci(x, n_boot=n_boot, ci=ci, seed=seed)


def proportion_or_mean_ci(values: Any, n_boot: int = 2000) -> tuple[float, float, float, int]:
    """Wilson interval when every value is 0 or 1 (a proportion), else the bootstrap of the mean."""
    x = np.asarray(pd.to_numeric(pd.Series(values, dtype=object), errors="coerce"), dtype=float)
    x = x[np.isfinite(x)]
    if x.size and np.all((x == 0.0) | (x == 1.0)):
        p, lo, hi = wilson_ci(int(x.sum()), int(x.size))
        return (p, lo, hi, int(x.size))
    return mean_ci(x, n_boot)


def to_float(s: pd.Series) -> pd.Series:
    """Booleans (possibly object dtype with NaN) and numbers as float; the rest NaN."""
    if s.dtype == object:
        s = s.map(lambda v: float(v) if isinstance(v, bool | int | float | np.bool_ | np.number) else math.nan)
    return pd.to_numeric(s, errors="coerce").astype(float)


def unit_means(df: pd.DataFrame, value: str, by: Sequence[str], unit: Sequence[str] = UNIT) -> pd.DataFrame:
    """Mean of `value` within each (by, unit) group; NaN rows dropped first."""
    cols = [c for c in dict.fromkeys([*by, *unit]) if c in df.columns]
    d = df[cols].copy()
    d["_v"] = to_float(df[value]) if value in df else math.nan
    d = d[np.isfinite(d["_v"])]
    if d.empty:
        return d.rename(columns={"_v": value})
    return d.groupby(cols, dropna=False, sort=True)["_v"].mean().rename(value).reset_index()


def ci_table(df: pd.DataFrame, value: str, by: Sequence[str] = ("model",), unit: Sequence[str] = UNIT,
             n_boot: int = 2000, proportion: bool = False) -> pd.DataFrame:
    """One row per `by` group: mean, lo, hi, n of `value` over units (see module doc).

    proportion=True: a group whose unit values are all 0/1 gets the Wilson interval (units
    whose rows were averaged to a fraction, e.g. random draws, fall back on the bootstrap)."""
    by = list(by)
    per_unit = unit_means(df, value, by, unit)
    rows = []
    if per_unit.empty:
        return pd.DataFrame(columns=[*by, *CI_COLUMNS])
    for key, g in per_unit.groupby(by, dropna=False, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        stat = proportion_or_mean_ci(g[value], n_boot) if proportion else mean_ci(g[value], n_boot)
        rows.append({**dict(zip(by, key)), **dict(zip(CI_COLUMNS, stat))})
    return pd.DataFrame(rows, columns=[*by, *CI_COLUMNS])


def widen_by_cluster(t: pd.DataFrame, df: pd.DataFrame, value: str, unit: Sequence[str] = UNIT,
                     cluster: str = "domain", n_boot: int = 2000) -> pd.DataFrame:
    """`t` (a ci_table by model) with each model's interval replaced by the cluster bootstrap over
    `cluster` (units' means resampled in whole clusters) where that one is wider; `cluster_note`
    says which interval stands and gives the other. Fewer than two clusters keep the item one."""
    if t.empty or cluster not in df:
        return t
    per_unit = unit_means(df, value, ["model", cluster], unit)
    notes, lo, hi = [], t["lo"].astype(float).copy(), t["hi"].astype(float).copy()
    for i, r in t.iterrows():
        g = per_unit[per_unit["model"] == r["model"]]
        c = cluster_bootstrap_ci(g[value].to_numpy(float), list(g[cluster].astype(str)), n_boot=n_boot)
        if not math.isfinite(c["ci_hi"] - c["ci_lo"]):
            notes.append("")
            continue
        wide = not math.isfinite(r["hi"] - r["lo"]) or c["ci_hi"] - c["ci_lo"] > r["hi"] - r["lo"]
        other = f"[{c['ci_lo']:.3f}, {c['ci_hi']:.3f}]" if not wide else f"[{r['lo']:.3f}, {r['hi']:.3f}]"
        if wide:
            lo[i], hi[i] = c["ci_lo"], c["ci_hi"]
        notes.append(f"interval: {'cluster bootstrap' if wide else 'item'} (the wider; "
                     f"{'item' if wide else 'cluster bootstrap'} {other}, {c['n_clusters']} {cluster}s)")
    return t.assign(lo=lo, hi=hi, cluster_note=notes)


def wilson(p: float, n: int) -> tuple[float, float]:
    """95 % Wilson interval of a proportion p observed over n trials (NaN when n = 0):
    kvnotes.measure.metrics.wilson_ci with k = round(p n)."""
    if n <= 0 or not math.isfinite(p):
        return (math.nan, math.nan)
    _, lo, hi = wilson_ci(int(round(p * n)), int(n))
    return (lo, hi)


def paired_ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int = 2000) -> tuple[float, float, float, int]:
    """Mean of per-pair ratios num/den with a bootstrap CI (pairs: repeats timed side by side)."""
    n = min(len(num), len(den))
    return mean_ci(np.asarray(num[:n], float) / np.asarray(den[:n], float), n_boot)


@functools.lru_cache(maxsize=1)
def reference() -> dict[str, Any]:
    """paper_reference.yaml: claims with the paper's values, targets and figures."""
    data = yaml.safe_load(REFERENCE.read_text())
    if not isinstance(data, dict) or "claims" not in data:
        raise ValueError(f"{REFERENCE}: expected a mapping with 'claims'")
    return data


def paper_value(claim: str, model: str | None = None) -> Any:
    """The paper's value of a claim for one of its models (None when it reports none)."""
    values = reference()["claims"][claim].get("values") or {}
    return values.get(model) if model is not None else values


def paper_range(claim: str) -> tuple[float, float] | None:
    """(min, max) over every numeric value the paper gives for a claim."""
    nums: list[float] = []
    for v in (reference()["claims"][claim].get("values") or {}).values():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int | float) and not isinstance(x, bool):
                nums.append(float(x))
    return (min(nums), max(nums)) if nums else None


def model_label(model: str) -> str:
    """'llama (SmolLM2-135M-Instruct)' from the model registry, else the name itself."""
    paper = reference().get("paper_models", {})
    if model in paper and model != "paper":
        return str(paper[model])
    try:

        desc = get_spec(model).description
    except Exception:  # noqa: BLE001 - an unregistered name (e.g. a tiny test model) is shown as is
        return model
    short = desc.split(" (")[0].split(" from ")[0]
    return f"{model} ({short})"


def layer_accuracy(layers: pd.DataFrame) -> pd.DataFrame:
    """Probe `linear` layer rows of one run: rel_layer, mean (accuracy), lo, hi (Wilson), n."""
    t = layers.sort_values("layer")
    acc = to_float(t["accuracy"]).to_numpy()
    n = to_float(t["n_prompts"]).fillna(0).astype(int).to_numpy()
    ci = [wilson(a, k) for a, k in zip(acc, n)]
    return pd.DataFrame({"layer": t["layer"].to_numpy(), "rel_layer": to_float(t["rel_layer"]).to_numpy(),
                         "mean": acc, "lo": [c[0] for c in ci], "hi": [c[1] for c in ci], "n": n})


def write_depth(acc: pd.DataFrame, threshold: float = 0.9) -> tuple[float, float, float]:
    """(depth, earliest, latest): first relative layer whose accuracy (its Wilson upper bound,
    its lower bound) reaches `threshold`; NaN where none does."""
    def first(col: str) -> float:
        hit = acc[acc[col] >= threshold]
        return float(hit["rel_layer"].iloc[0]) if len(hit) else math.nan
    return (first("mean"), first("hi"), first("lo"))


# --- serving and memory: per-request / per-question views of their records --------------------


def serving_view(frame: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """Requests of experiment `serving` as (model, run_id, arm, phase, rate, request, ttft_ms,
    censored, hit), or why there are none.

    arm = the prompt variant (edit: state rewritten in the prefix with a new request id;
    edit_field: only the field rewritten; erratum: appended; hoist);
    ttft_ms = the client TTFT, or for a request cancelled at the phase cap its lower bound
    (censored = True); hit = the phase's prefix-cache hit rate (vLLM counter delta over the phase:
    one number per variant and phase, repeated on its requests). Errored requests are dropped, and
    so is the items phase (one request per item and value, for the decisions: no load phase).
    phase_label: sequential, `<rate> req/s` (a rate the edit sustains) or `overload <rate> req/s`.
    """
    d = frame[frame["job"] == "serving"] if "job" in frame else frame.iloc[:0]
    if d.empty:
        return d, "no completed run of experiment serving"
    arm = next((c for c in ("variant", "arm") if c in d), None)
    if arm is None or "ttft_s" not in d:
        return d.iloc[:0], "serving records lack the variant / ttft_s columns of experiments/serving.py"
    if "status" in d:
        d = d[d["status"] != "error"]
    if "phase" in d:
        d = d[d["phase"] != "items"]
    ttft = to_float(d["ttft_s"])
    lower = to_float(d["ttft_lower_s"]) if "ttft_lower_s" in d else pd.Series(math.nan, index=d.index)
    censored = ttft.isna() & lower.notna()
    out = pd.DataFrame({
        "model": d["model"], "run_id": d["run_id"], "arm": d[arm].astype(str),
        "phase": d["phase"].astype(str) if "phase" in d else "poisson",
        "rate": to_float(d["rate"]) if "rate" in d else math.nan,
        "request": d["request_id"] if "request_id" in d else np.arange(len(d)),
        "ttft_ms": 1000 * ttft.where(~censored, lower), "censored": censored,
        "hit": to_float(d[next((c for c in ("phase_hit_rate", "hit_rate") if c in d), "ttft_s")])
        if any(c in d for c in ("phase_hit_rate", "hit_rate")) else math.nan,
        "hit_tokens": to_float(d["phase_hit_tokens"]) if "phase_hit_tokens" in d else math.nan,
        "query_tokens": to_float(d["phase_query_tokens"]) if "phase_query_tokens" in d else math.nan,
    })
    out["phase_label"] = [p if p == "sequential" or not math.isfinite(r) else
                          f"overload {r:g} req/s" if p == "overload" else f"{r:g} req/s"
                          for p, r in zip(out["phase"], out["rate"])]
    return out, None


def quantile_ratio_ci(num: Any, den: Any, q: float = 0.9, n_boot: int = 2000,
                      seed: int = 0) -> tuple[float, float, float, int]:
    """quantile_q(num) / quantile_q(den) with a bootstrap CI, each sample resampled on its own."""
    a = np.asarray(num, float)
    b = np.asarray(den, float)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    n = int(min(a.size, b.size))
    if n == 0:
        return (math.nan, math.nan, math.nan, 0)
    point = float(np.quantile(a, q) / np.quantile(b, q))
    if a.size < 2 or b.size < 2:
        return (point, math.nan, math.nan, n)
    from scipy.stats import bootstrap  # deferred: scipy.stats takes ~0.5 s; paired intervals only

    def ratio(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(np.quantile(x, q, axis=axis) / np.quantile(y, q, axis=axis))

    res = bootstrap((a, b), ratio, n_resamples=n_boot, paired=False, vectorized=True,
                    method="percentile", rng=np.random.default_rng(seed))
    return (point, float(res.confidence_interval.low), float(res.confidence_interval.high), n)


def memory_view(frame: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """Experiment `memory` as (model, run_id, unit, delta, cosine, source), or why there is none.

    LoCoMo questions when the run has them (delta = token F1 of the transplanted minus the fully
    recomputed answer, cosine of their first-token logits); otherwise the synthetic items'
    transplant + erratum against the full prefill of the new prompt (delta = accuracy difference).
    """
    d = frame[frame["job"] == "memory"] if "job" in frame else frame.iloc[:0]
    if d.empty or "kind" not in d:
        return d.iloc[:0], "no completed run of experiment memory"
    lo = d[d["kind"] == "locomo"]
    if len(lo):
        return pd.DataFrame({
            "model": lo["model"], "run_id": lo["run_id"],
            "unit": lo["conversation"].astype(str) + "/" + lo["question_index"].astype(str),
            "delta": to_float(lo["f1_transplant"]) - to_float(lo["f1_full"]),
            "cosine": to_float(lo["cosine"]), "conversation": lo["conversation"].astype(str),
            "source": "LoCoMo QA (token F1)"}), None
    syn = d[(d["kind"] == "synthetic") & (d["condition"] == "transplant_erratum") & (d["reference"] == "full_new")]
    if syn.empty:
        return syn, "memory run has neither LoCoMo nor synthetic transplant_erratum records"
    return pd.DataFrame({
        "model": syn["model"], "run_id": syn["run_id"], "unit": syn["item_id"],
        "delta": to_float(syn["correct"]) - to_float(syn["correct_ref"]), "cosine": to_float(syn["cosine"]),
        "source": "synthetic memory items, transplant + erratum vs full prefill of the new prompt (accuracy)"}), None
