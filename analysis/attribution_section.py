"""The report's "attribution vs exact" section: per attribution run (`+probe=attribution`), how
well one backward pass ranks the cache entries that exact patching ranks (Spearman over positions
and over position x layer cells, top-k overlaps, the recovery of the top-8 each method picks,
sign agreement, how much AtP*'s QK fix moves the estimate) with item and domain-cluster intervals,
read from each run's summary.json (probes/attribution.py computed them from records); and the cost
of both maps as a ratio to one prefill, from every committed engine benchmark that timed them side
by side (`benchmarks.engine --map --attribution`). Beyond the paper: no band, no verdict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell
from analysis.load import summaries
from analysis.sections import Inputs, section


def _cell(s: dict[str, Any], name: str, digits: int = 3) -> str:
    """mean [item CI] (domain cluster lo, hi) of one statistic, '-' when the run has none."""
    d = (s.get("stats") or {}).get(name)
    if not isinstance(d, dict) or not d.get("n"):
        return "-"
    c = (s.get("stats_cluster") or {}).get(name) or {}
    lo = c.get("ci_lo")
    pair = f" ({lo:.{digits}f}, {c['ci_hi']:.{digits}f})" if lo is not None and lo == lo else ""
    return ci_cell(d, digits) + pair


def _layer_cell(s: dict[str, Any]) -> str:
    """The position x layer Spearman with how many cells exact patching read per item: every cell,
    or a uniform random sample of them; a full run also says how far a sample's estimate fell."""
    cell = _cell(s, "spearman_position_layer")
    if cell == "-":
        return "not run"
    st = s.get("stats") or {}
    read, every = ((st.get(n) or {}).get("mean") for n in ("n_layer_cells", "n_layer_cells_all"))
    if read and every and read < every:
        return cell + f"; a uniform sample of {read:.0f} of {every:.0f} cells per item"
    err = s.get("layer_sample_error")
    if err:
        return cell + (f"; every cell (a {err['cells']}-cell sample of the same items is off by "
                       f"{err['mean']:+.3f} on average, at most {err['max_abs']:.3f})")
    return cell + "; every cell"


def benchmark_rows(results: str | Path) -> list[str]:
    """One table row per length of each committed engine benchmark that timed both maps."""
    rows = []
    for path in sorted(Path(results, "benchmarks").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for r in data if isinstance(data, list) else []:
            if isinstance(r, dict) and r.get("attribution_ratio") is not None:
                cpu = (r.get("cpu") or {}).get("model") or r.get("device", "")
                rows.append(f"| {r.get('model')} {r.get('dtype')} | {r.get('length')} | {r.get('prefill_s', float('nan')):.2f} | "
                            f"{r.get('map_ratio', float('nan')):.2f} | {r['attribution_ratio']:.3f} | "
                            f"{r.get('map_over_attribution', float('nan')):.1f} | {r.get('reps')} | {cpu} | `{path.name}` |")
    return rows


def attribution_section(frame: pd.DataFrame, results: str | Path) -> list[str]:
    """Markdown lines; [] when no attribution run was read."""
    runs = list(summaries(frame, "attribution"))
    if not runs:
        return []
    lines = ["## Attribution over the cache against exact patching (beyond the paper)", "",
             "`+probe=attribution`: per usable item, one forward and one backward estimate the effect of patching "
             "every cached K and V entry (position x layer x KV head) from the new prompt into the old, keys with "
             "AtP*'s QK fix (the attention pattern at the readout recomputed exactly for the patched keys); exact "
             "patching reads the same entries one variant at a time. Spearman: rank correlation per item between "
             "the two maps over the field and every later position (summed over layers and heads), and over "
             "position x layer cells; overlap: the share of the top-k positions both pick; recovery: the joint "
             "patch of the top 8 each picks, as a share of the way from the old decision score to the new (past 1 "
             "is overshoot); sign agreement over positions that move the decision at least 1 % of the way; QK "
             "change: summed |QK-fixed - linear| key estimate over summed |linear|. Means over items [95 % item "
             "bootstrap] (domain cluster bootstrap: items share a domain's templates). No method needs the "
             "oracle beyond the pair of prompts.", "",
             "| model | run | usable items | Spearman, positions | Spearman, linear keys | Spearman, position x layer "
             "| top-8 overlap | top-32 overlap | top-8 recovery: attribution / exact | sign agreement | QK change "
             "| exact / attribution time per item |", "|---" * 12 + "|"]
    for model, run_id, s in runs:
        st = s.get("stats") or {}
        rec = f"{_cell(s, 'recovery_top8_attribution', 2)} / {_cell(s, 'recovery_top8_exact', 2)}"
        ratio = s.get("cost_exact_over_attribution")
        lines.append(f"| {model_label(model)} | `{run_id}` | {s.get('n_usable')} of {s.get('n_items')} | "
                     f"{_cell(s, 'spearman_position')} | {ci_cell(st.get('spearman_position_linear'))} | "
                     f"{_layer_cell(s)} | {_cell(s, 'overlap_8', 2)} | {_cell(s, 'overlap_32', 2)} | {rec} | "
                     f"{_cell(s, 'sign_agree', 2)} | {ci_cell(st.get('qk_change'), 2)} | "
                     f"{f'{ratio:.1f}x' if ratio else '-'} |")
    worst = [f"{model_label(m)} {s['worst_layer_counts']}" for m, _, s in runs if s.get("worst_layer_counts")]
    if worst:
        lines += ["", "Where attribution misses most (the layer with the largest mean |attribution - exact| per item, "
                  "items per layer): " + "; ".join(worst) + "."]
    bench = benchmark_rows(results)
    lines += ["", "Cost beside one prefill of the same prompt, timed side by side in one run "
              "(`python -m benchmarks.engine --only edit --map --attribution`; medians of interleaved repeats; "
              "compare only within a row's run):", ""]
    lines += (["| model | tokens | prefill s | exact per-position map / prefill | attribution / prefill "
               "| exact / attribution | reps | machine | JSON |", "|---" * 9 + "|", *bench]
              if bench else ["No committed benchmark timed both maps yet."])
    return [*lines, ""]


@section('Attribution against exact patching', 80, jobs=('attribution',), reads=('stats', 'stats_cluster'))
def _render(inputs: Inputs) -> list[str]:
    return attribution_section(inputs.frame, inputs.results)
