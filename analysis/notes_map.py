"""The notes map: per-token recovery drawn over the prompt text, as PNG and self-contained HTML.

For one item of a `patching` or `attribution` run, each token is coloured by the recovery obtained
when only that position (all layers) is patched from the new run into the old one: the tokens
where the model keeps its field-conditioned notes light up; the field itself stays pale.
`--method exact` draws the exact patching map (both probes write it); `--method attribution` the
estimate of an `attribution` run (one backward pass, AtP* QK fix: kvnotes.edit.attribution).
Positions before the field hold identical K/V in both runs and are drawn at 0; a position an
attribution run did not patch exactly (probe.exact=false) is NaN in the exact map, drawn at 0.

    python -m analysis.notes_map --run results/runs/patching/llama/<timestamp> [--item ID] [--out DIR]
    python -m analysis.notes_map --run results/runs/attribution/llama/<timestamp> --method attribution
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvnotes.measure import runfiles

METHODS = {"exact": "recovery", "attribution": "attribution"}  # --method -> the position rows' column


def item_map(records: pd.DataFrame, item_id: str, method: str = "exact") -> tuple[list[str], np.ndarray, tuple[int, int], dict[str, Any]]:
    """(tokens, per-token recovery, field span, info) of one item of a patching or attribution run;
    `method` picks the exact map or attribution's estimate."""
    if method not in METHODS:
        raise ValueError(f"unknown notes-map method {method!r}; valid: {', '.join(METHODS)}")
    column = METHODS[method]
    if column not in records.columns:
        raise ValueError(f"this run has no {method} map (column {column!r}): run +probe=attribution for it")
    rows = records[records["item_id"] == item_id]
    tok_rows = rows[rows["condition"] == "tokens"]
    if tok_rows.empty:
        raise ValueError(f"item {item_id!r} has no token row (skipped, or run with per_position=false)")
    tokens = [str(t) for t in tok_rows.iloc[0]["tokens"]]
    rec = np.zeros(len(tokens))
    pos = rows[rows["condition"] == "position"]
    rec[pos["position"].astype(int).to_numpy()] = np.nan_to_num(pos[column].to_numpy(dtype=float))
    first = tok_rows.iloc[0]
    span = (int(first["field_start"]), int(first["field_end"]))
    cond = rows[rows["condition"].isin(["field_only", "full_downstream"])].set_index("condition")["recovery"]
    info = {"item_id": item_id, "domain": first["domain"], "n_tokens": len(tokens), "method": method,
            "field_only": float(cond.get("field_only", math.nan)),
            "full_downstream": float(cond.get("full_downstream", math.nan))}
    return tokens, rec, span, info


def _conditions(info: dict[str, Any]) -> str:
    """'field-only 0.010, full-downstream 1.000; ' from a patching run; '' where the run has none."""
    parts = [f"{label} {info[key]:.3f}" for key, label in (("field_only", "field-only"), ("full_downstream", "full-downstream"))
             if math.isfinite(info.get(key, math.nan))]
    return ", ".join(parts) + "; " if parts else ""


def _colour(r: float, vmax: float) -> str:
    """White -> red for positive recovery, white -> blue for negative."""
    x = max(-1.0, min(1.0, r / vmax)) if vmax > 0 and math.isfinite(r) else 0.0
    if x >= 0:
        return f"rgb(255,{int(255 * (1 - x))},{int(255 * (1 - x))})"
    return f"rgb({int(255 * (1 + x))},{int(255 * (1 + x))},255)"


def to_html(tokens: list[str], rec: np.ndarray, span: tuple[int, int], info: dict[str, Any], model: str) -> str:
    vmax = float(np.nanmax(np.abs(rec))) if rec.size else 1.0
    spans = []
    for i, (t, r) in enumerate(zip(tokens, rec, strict=True)):
        style = f"background:{_colour(r, vmax)}"
        if span[0] <= i < span[1]:
            style += ";outline:2px solid #2a7"
        text = html.escape(t).replace("\n", "↵<br>")
        spans.append(f'<span title="pos {i}: recovery {r:.3f}" style="{style}">{text}</span>')
    title = (f"Notes map ({info.get('method', 'exact')}) — {model} — {info['item_id']} ({_conditions(info)}"
             f"colour = single-position recovery, max |r| {vmax:.2f})")
    return ("<!doctype html><meta charset='utf-8'><title>notes map</title>"
            "<style>body{font:13px/1.6 monospace;max-width:70em;margin:2em auto;white-space:pre-wrap}"
            "span{border-radius:2px}</style>"
            f"<h3>{html.escape(title)}</h3><p>green outline: the field; hover a token for its value.</p>"
            f"<div>{''.join(spans)}</div>")


def to_png(tokens: list[str], rec: np.ndarray, span: tuple[int, int], info: dict[str, Any], model: str, path: Path) -> None:
    import matplotlib  # deferred: the backend is chosen before pyplot loads, PNG output only

    matplotlib.use("Agg")
    # deferred: matplotlib is heavy and only this path needs it
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(2, 1, figsize=(12, 4.5), gridspec_kw={"height_ratios": [1, 2]})
    vmax = float(np.nanmax(np.abs(rec))) or 1.0
    ax.imshow(rec[None], aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    ax.set_yticks([])
    ax.axvspan(span[0] - 0.5, span[1] - 0.5, color="green", alpha=0.3, label="field")
    ax.set_title(f"Notes map ({info.get('method', 'exact')}) — {model} — {info['item_id']} (n_tokens={len(tokens)})",
                 fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    top = np.argsort(-np.nan_to_num(rec))[:20]
    top = top[np.argsort(top)]
    bx.bar(range(len(top)), rec[top], color="tab:red")
    bx.set_xticks(range(len(top)), [f"{p}:{tokens[p]!r}"[:14] for p in top], rotation=60, fontsize=7)
    bx.set_ylabel("single-position recovery")
    bx.set_title(f"top-20 positions ({_conditions(info).removesuffix('; ') or 'no field-only / full-downstream rows'})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.notes_map", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=Path, help="a patching or attribution run directory")
    p.add_argument("--method", choices=tuple(METHODS), default="exact",
                   help="exact: the exact patching map; attribution: the estimate of an attribution run")
    p.add_argument("--item", default=None, help="item id (default: the usable item with the largest |score delta|)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: <run>/figures)")
    a = p.parse_args(argv)
    records = pd.read_parquet(a.run / runfiles.RECORDS)
    model = json.loads((a.run / runfiles.META).read_text()).get("model_name", "?")
    usable = records[records["condition"] == "tokens"]
    if usable.empty:
        raise SystemExit(f"{a.run}: no item with a per-position map (all skipped, or per_position=false)")
    item = a.item or usable.assign(d=(usable["score_oracle"] - usable["score_stale"]).abs()).sort_values("d").iloc[-1]["item_id"]
    try:
        tokens, rec, span, info = item_map(records, item, a.method)
    except ValueError as e:
        raise SystemExit(f"{a.run}: {e}") from None
    out = a.out or a.run / "figures"
    out.mkdir(parents=True, exist_ok=True)
    stem = "notes_map_" + ("" if a.method == "exact" else f"{a.method}_") + "".join(c if c.isalnum() else "_" for c in item)
    (out / f"{stem}.html").write_text(to_html(tokens, rec, span, info, model))
    to_png(tokens, rec, span, info, model, out / f"{stem}.png")
    print(f"wrote {out / stem}.html and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
