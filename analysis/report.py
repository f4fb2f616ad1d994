"""The reproduction report: per claim of the paper, our value with its CI per model beside the
paper's value, a verdict in plain words, and the figure that shows it.

    python -m analysis.report [--results results/reference] [--figures results/figures] [--out results/REPORT.md]

Our numbers are recomputed from records.parquet (means over items with 95 % bootstrap CIs,
analysis.claims), never copied from summary.json; summary.json is only cross-checked. The
paper's numbers and our reading of each claim as a band come from paper_reference.yaml. Our
models are not the paper's: a verdict says whether our CI overlaps the claim's band, not that
the paper's model would behave like ours. A claim nothing measured stays absent, never zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import load, sections
from analysis.aggregate import model_label, reference, to_float
from analysis.claims import all_claims
from analysis.claims import ours as ours  # re-exported: notebooks call report.ours(frame, claim)
from analysis.figures import build_all
from analysis.reference import in_history
from analysis.verdicts import band, verdict
from kvnotes.measure import runfiles
from kvnotes.measure.metrics import raw_p_correct

# --- cells --------------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 3) -> str:
    """A number with `digits` decimals (fewer above 10); '-' for None and NaN."""
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    x = float(x)
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}f}"


def excludes(target: dict[str, Any] | None, lo: float, hi: float) -> str:
    """Where the paper says "about 0" or "about 1" (an approx band at 0 or 1): whether our
    interval excludes that value, as a clause for the verdict ('' elsewhere or without a CI)."""
    if not target or "approx" not in target or float(target["approx"]) not in (0.0, 1.0):
        return ""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    v = float(target["approx"])
    return f"; our CI {'includes' if lo <= v <= hi else 'excludes'} {v:g}"


def describe(target: dict[str, Any] | None, digits: int = 3) -> str:
    b = band(target)
    if b is None:
        return "no band (model-specific number, shown for reference)"
    if math.isinf(b[0]):
        return f"<= {fmt(b[1], digits)}"
    if math.isinf(b[1]):
        return f">= {fmt(b[0], digits)}"
    return f"[{fmt(b[0], digits)}, {fmt(b[1], digits)}]"


def history(c: dict[str, Any], digits: int = 3) -> str:
    """The band's provenance (paper_reference.yaml `band_history`, derived from git once and
    recorded there): the commit that set it, whether a report showing our value existed then, and
    the band it replaced ('' for a claim without a band history)."""
    h = c.get("band_history")
    if not h:
        return ""
    s = f"Band set in {h['set_in']}; a report showing our value existed then: {'yes' if h['report_before'] else 'no'}"
    r = h.get("replaced")
    if r:
        s += (f"; it replaced the band {describe(r['target'], digits)} set in {r['in']}, whose verdict each row "
              "gives beside the current one")
    return s + "."


def replaced_verdict(c: dict[str, Any], mean: float, lo: float, hi: float, n: int,
                     zero_eps: float | None = None, digits: int = 3) -> str:
    """' (under the replaced band ...: verdict)' where the claim's band replaced an earlier one,
    read by the one verdict function; '' elsewhere."""
    r = (c.get("band_history") or {}).get("replaced")
    if not r:
        return ""
    v = verdict(r["target"], mean, lo, hi, n, zero_eps) + excludes(r["target"], lo, hi)
    return f" (under the replaced band {describe(r['target'], digits)}: {v})"


def post_hoc(c: dict[str, Any]) -> bool:
    """Whether the claim's band was set after a report showing our value existed."""
    return bool((c.get("band_history") or {}).get("report_before"))


def paper_cell(values: dict[str, Any], model: str, digits: int = 3) -> str:
    """The paper's number for this very model if it has one, else all of them with their models."""
    names = reference().get("paper_models", {})

    def one(v: Any) -> str:
        return " / ".join(fmt(x, digits) for x in v) if isinstance(v, list) else fmt(v, digits)
    if model in values:
        return f"{one(values[model])} (same model)"
    return "; ".join(f"{names.get(k, k)} {one(v)}" if k != "paper" else one(v) for k, v in values.items())


# --- the report ---------------------------------------------------------------------------------


def dev_runs(frame: pd.DataFrame) -> set[str]:
    """Runs whose margin is below their model config's margin (development runs)."""
    if frame.empty:
        return set()
    r = frame.drop_duplicates("run_id")
    m, d = pd.to_numeric(r["margin"], errors="coerce"), pd.to_numeric(r["model_margin"], errors="coerce")
    return set(r.loc[m < d, "run_id"].astype(str))


def _summary(run_path: Any) -> dict[str, Any]:
    path = Path(str(run_path)) / runfiles.SUMMARY
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def usable_cell(summary: dict[str, Any], d: pd.DataFrame) -> str:
    """'items (usable)' from the run's summary.json (the counts its job computed), else '-'."""
    n = summary.get("n_items")
    if n is None:
        return "-"
    parts = [f"{summary[k]}{label}" for k, label in (("n_usable", ""), ("n_usable_recovery", " recovery"),
                                                      ("n_usable_p_correct", " P(correct)"),
                                                      ("n_usable_p_correct_raw", " P(correct) uncalibrated"),
                                                      ("n_usable_correct", " P(correct)")) if k in summary]
    return f"{n} ({', '.join(parts)})" if parts else str(n)


def runs_section(frame: pd.DataFrame) -> list[str]:
    lines = ["| run | model | dtype | task | items (usable) | margin | commit |", "|---|---|---|---|---|---|---|"]
    flagged = False
    for run_id, d in frame.groupby("run_id", sort=True):
        r = d.iloc[0]
        summary = _summary(r.get("run_path"))
        margin = "-" if pd.isna(r.get("margin")) else f"{r['margin']:g}"
        rule = summary.get("margin_rule")
        if isinstance(rule, str) and ": derived" in rule:
            margin += " (derived)"
        if pd.notna(r.get("margin")) and pd.notna(r.get("model_margin")) and r["margin"] < r["model_margin"]:
            margin += f" < {r['model_margin']:g} (development run)"
            flagged = True
        commit = str(r.get("commit") or "?")[:7] + (" (dirty)" if str(r.get("dirty")) == "True" else "")
        task = r["task"] if r["job_kind"] == "probe" or r["job"] in load.MARGIN_JOBS else "-"
        dtype = r.get("dtype") if isinstance(r.get("dtype"), str) else "-"
        lines.append(f"| `{run_id}` | {r['model']} | {dtype} | {task} | {usable_cell(summary, d)} | {margin} | {commit} |")
    if flagged:
        lines += ["", "**Runs marked *development run* judged items with a margin below the model's; "
                      "their numbers are for checking the pipeline, not findings.**"]
    return lines


def dirty_section(frame: pd.DataFrame) -> list[str]:
    """Runs whose code is not exactly a commit of this checkout (made from a dirty tree, or from a
    commit outside its history): forced into the reference set, or older."""
    runs = frame.drop_duplicates("run_id")
    out = []
    for r in runs.sort_values("run_id").itertuples():
        commit = str(r.commit or "?")
        if str(getattr(r, "dirty", None)) == "True":
            why = "uncommitted changes"
        elif r.commit and in_history(commit, Path(str(r.run_path))) is False:
            why = "a commit not in this checkout's history"
        else:
            continue
        how = ("forced in with `analysis.reference --force`" if str(getattr(r, "forced", None)) == "True"
               else "copied before `analysis.reference` refused such runs")
        out.append(f"- `{r.run_id}` (commit {commit[:7]}, {why}): {how}")
    if not out:
        return ["Every run read comes from a clean commit."]
    return [f"{len(out)} of {len(runs)} runs read were not made from a clean commit of this checkout; "
            "their code is not exactly a commit you can check out:", "", *out]


def summary_checks(frame: pd.DataFrame) -> list[str]:
    """Recomputed means vs the summary.json of each run, where both report the same number."""
    out = []
    for run_id, d in frame.groupby("run_id"):
        path = Path(str(d["run_path"].iloc[0])) / runfiles.SUMMARY
        if not path.exists():
            continue
        s = json.loads(path.read_text())
        pairs: list[tuple[str, float, Any]] = []
        job = d["job"].iloc[0]
        if job == "patching":
            for c, v in (s.get("recovery") or {}).items():
                pairs.append((f"recovery/{c}", to_float(d.loc[d["condition"] == c, "recovery"]).mean(), v.get("mean")))
        elif job in ("edit", "wording"):
            usable, correct = raw_p_correct(*(to_float(d[c]) for c in ("score", "score_stale", "score_oracle")),
                                            to_float(d["usable_recovery"]) > 0)
            for st, v in (s.get("strategies") or {}).items():
                rows = d[(d["strategy"] == st) & (to_float(d["usable_p_correct"]) > 0)]
                pairs.append((f"p_correct/{st}", to_float(rows["correct"]).mean(), v["p_correct"].get("mean")))
                if "p_correct_raw" in v:
                    raw = correct[(d["strategy"] == st).to_numpy() & usable]
                    pairs.append((f"p_correct_raw/{st}", float(raw.mean()) if raw.size else math.nan,
                                  v["p_correct_raw"].get("mean")))
        elif job in ("selfcheck", "compose"):
            for k, v in (s.get("seams") or {}).items():
                rows = d[(d["seam"] == int(k)) & ((d["kind"] == "fidelity") if job == "compose" else True)]
                ref = v.get("cosine") if job == "selfcheck" else (v.get("cosine") or {}).get("mean")
                pairs.append((f"cosine/K={k}", to_float(rows["cosine"]).mean(), ref))
        bad = [(k, a, b) for k, a, b in pairs
               if b is not None and not (pd.isna(a) and pd.isna(b)) and not math.isclose(a, float(b), rel_tol=1e-6, abs_tol=1e-9)]
        if pairs:
            out.append(f"- `{run_id}`: {len(pairs) - len(bad)} of {len(pairs)} summary.json means reproduced"
                       + ("" if not bad else "; differ: " + ", ".join(f"{k} ({fmt(a)} vs {fmt(b)})" for k, a, b in bad)))
    return out or ["- no run with a summary.json to check"]


def undefined_reasons(frame: pd.DataFrame, job: str) -> list[tuple[str, str]]:
    """(model, why) for each newest `job` run whose summary.json says why a quantity is undefined
    (a `*_why` field, such as the linear probe's write_depth_why), so a claim that run was meant
    to measure reads "undefined, because ..." rather than "no run". The run's own one-line
    `reading` is the explanation where it has one (the linear probe's covers both label sets at
    their best aggregator), else the `*_why` fields."""
    out = []
    for model, _, s in load.newest_summaries(frame, job):
        why = [str(v).rstrip(".") for k, v in s.items() if k.endswith("_why") and v]
        if why:
            out.append((model, str(s["reading"]).rstrip(".") if s.get("reading") else "; ".join(why)))
    return out


def render(frame: pd.DataFrame, results: Path, fig_dir: Path, out: Path,
           figures: Any | None = None) -> str:
    ref = reference()
    claims = ref["claims"]
    table = all_claims(frame, list(claims))
    made = dict(figures.made) if figures is not None else {}
    skipped = dict(figures.skipped) if figures is not None else {}
    models = sorted(set(frame["model"].dropna())) if len(frame) else []
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Reproduction report", "",
        f"Generated by `python -m analysis.report --results {results}` on {now}; figures in `{fig_dir}`.", "",
        "How to read it. Each claim of the paper (docs/paper.md) is restated with the paper's number and our "
        "value per model: the mean over usable items with a 95 % confidence interval (percentile bootstrap "
        "over items, draws of one item averaged first; Wilson for proportions; n = items, or the unit named "
        "in the note), recomputed from `records.parquet`. Items that share a domain (its templates) or a LoCoMo "
        "conversation are not independent, so beside that interval a cluster bootstrap resamples whole domains "
        "(conversations for LoCoMo) and the verdict uses the wider of the item and cluster intervals; the note "
        "says which one stands and gives the other. Where the paper says \"about 0\" or \"about 1\", the verdict "
        "also says whether our interval excludes that value. P(correct) reads decisions calibrated against a "
        "content-free prompt (the field's value replaced by \"N/A\"; its logits subtracted before the argmax), "
        "over the items whose stale and oracle prompts decide right that way; the note gives the uncalibrated "
        "P(correct) (raw argmax, over the items usable without calibration) beside it, with no verdict of its "
        "own. Rows that equal the oracle by construction (full-downstream) are labelled identities and not "
        "counted among the verdicts. Each claim's band comes with a sentence saying where it comes from and "
        "with its history: the commit that set it and whether a report showing our value existed then. Most "
        "bands were written from the paper's numbers before any report showed ours; those set after one were "
        "not written blind: the table at a glance counts their rows apart, and where such a band replaced an "
        "earlier one each row gives the verdict under the earlier band beside the current one. *consistent* "
        "means our CI lies inside the band, *overlaps* that it only overlaps it, *differs* that it lies wholly outside. "
        "A recovery whose CI lies within one score step of the run's dtype of zero (bfloat16: 1/16 logit; "
        "in recovery units the step divided by the item's |score_oracle - score_stale|, averaged over items; "
        "float32's 2^-20 is negligible) is read as zero, not as a non-zero effect. Our models are small CPU "
        "models (" +
        ", ".join(model_label(m) for m in models) + "), not the paper's 7-32B models: agreement or "
        "disagreement is about these models, and a paper number for another model is context, not a target "
        "they must meet. Absent data stays absent: a claim no run measured says so.", "",
    ]
    dev = dev_runs(frame)
    if dev:
        lines += [f"**Warning: {len(dev)} of the runs read judged items with a margin below their model's "
                  "(development runs). Their numbers check the pipeline; they are not findings.**", ""]
    counts: dict[str, int] = {}
    after: dict[str, int] = {}  # rows on a band set after a report showed our value
    identities = 0
    body: list[str] = []
    shown: set[str] = set()
    for cid, c in claims.items():
        rows = table[table["claim"] == cid]
        dg = int(c.get("digits", 3))
        body += [f"### {cid} (section {c.get('section')})", "", c["claim"], ""]
        if c.get("measured_by") is None:
            body += ["*Not measured*: no probe or experiment of the toolkit measures this yet.", ""]
            counts["not measured"] = counts.get("not measured", 0) + 1
            continue
        source = f" {c['band_source']}" if c.get("band_source") else ""
        body += [f"Measure: {c.get('measure')}. Band: {describe(c.get('target'), dg)}.{source}", ""]
        if history(c, dg):
            body += [history(c, dg), ""]
        if rows.empty:
            undefined = undefined_reasons(frame, str(c["measured_by"]))
            if undefined:
                body += [f"*No data*: the `{c['measured_by']}` runs under `{results}` leave it undefined. "
                         + " ".join(f"{model_label(m)}: {why}." for m, why in undefined), ""]
            else:
                body += [f"*No data*: no completed `{c['measured_by']}` run under `{results}` measures it.", ""]
            counts["no data"] = counts.get("no data", 0) + 1
            after["no data"] = after.get("no data", 0) + post_hoc(c)
        else:
            body += ["| model | ours | 95 % CI | n | paper | verdict | note |", "|---|---|---|---|---|---|---|"]
            for r in rows.itertuples():
                v = verdict(c.get("target"), r.mean, r.lo, r.hi, r.n, r.zero_eps) + excludes(c.get("target"), r.lo, r.hi)
                if c.get("identity"):
                    v = f"identity, not a verdict ({v.split(';')[0]}): {c['identity']}"
                    identities += 1
                else:
                    key = v.split(":")[0].split(" (")[0].split(";")[0]
                    counts[key] = counts.get(key, 0) + 1
                    after[key] = after.get(key, 0) + post_hoc(c)
                    v += replaced_verdict(c, r.mean, r.lo, r.hi, r.n, r.zero_eps, dg)
                note = "; ".join(x for x in (r.note, "DEVELOPMENT RUN" if set(str(r.runs).split(", ")) & dev else "") if x)
                body.append(f"| {model_label(r.model)} | {fmt(r.mean, dg)} | [{fmt(r.lo, dg)}, {fmt(r.hi, dg)}] | "
                            f"{r.n} | {paper_cell(c.get('values') or {}, r.model, dg)} | {v} | {note} |")
            body.append("")
        fig = c.get("figure")
        if fig and fig in made and fig in shown:
            body += [f"Figure: `{fig}` (above).", ""]
        elif fig and fig in made:
            png = next(p for p in made[fig] if str(p).endswith(".png"))
            body += [f"![{fig}]({os.path.relpath(png, out.parent)})", ""]
            shown.add(fig)
        elif fig and fig in skipped:
            body += [f"Figure `{fig}` skipped: {skipped[fig]}.", ""]
    lines += ["## Verdicts at a glance", "",
              "| verdict | claims x models | of them on a band set after a report showed our value |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {after.get(k, 0)} |" for k, v in sorted(counts.items())] + [""]
    if sum(after.values()):
        late = ", ".join(cid for cid, c in claims.items() if post_hoc(c))
        lines += [f"{sum(after.values())} row(s) stand on a band set after a committed report showed our value "
                  f"({late}): not written blind; where such a band replaced an earlier one, its rows also give the "
                  "verdict under the earlier band.", ""]
    if identities:
        lines += [f"Not counted: {identities} identity row(s) (full-downstream equals the oracle by construction).", ""]
    pngs = {k: os.path.relpath(next(p for p in v if str(p).endswith(".png")), out.parent)
            for k, v in made.items() if any(str(p).endswith(".png") for p in v)}
    lines += ["## Claims", "", *body, *sections.render_all(sections.Inputs(frame, Path(results), pngs))]
    if len(frame):
        lines += ["## Runs", "", *runs_section(frame), "", "### Runs not from a clean commit", "", *dirty_section(frame), "",
                  "## Cross-check against summary.json", "",
                  *summary_checks(frame), ""]
    if figures is not None:
        lines += ["## Figures", ""]
        lines += [f"- `{k}`: {', '.join(os.path.relpath(p, out.parent) for p in v)}" for k, v in made.items()]
        lines += [f"- `{k}`: skipped ({v})" for k, v in skipped.items()]
        lines += [f"- `{k}`: FAILED ({v})" for k, v in figures.failed.items()] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("results/reference"))
    p.add_argument("--figures", type=Path, default=Path("results/figures"),
                   help="where the figures are (re)drawn (default: results/figures)")
    p.add_argument("--out", type=Path, default=Path("results/REPORT.md"))
    p.add_argument("--no-figures", action="store_true", help="do not redraw the figures")
    a = p.parse_args(argv)
    if not a.results.is_dir():
        print(f"error: {a.results} is not a folder of runs (your own runs: --results results/runs)")
        return 2

    frame = load.load(a.results)
    figures = None if a.no_figures else build_all(frame, a.figures)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(render(frame, a.results, a.figures, a.out, figures))
    print(f"wrote {a.out} ({frame['run_id'].nunique() if len(frame) else 0} runs)")
    return 1 if figures is not None and figures.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
