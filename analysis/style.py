"""One look for every figure: colours per model and condition, CI bands, title, caption, PNG + PDF.

Every figure says what it shows in its title, and in its caption which models, how many units
(n) and which runs (run id, commit, margin) it was drawn from; shaded bands and error bars are
95 % bootstrap CIs unless the caption says otherwise. Paper values are drawn in grey, dashed.
A run whose margin is below its model's registered margin is flagged in the caption: such runs
are for development only.
"""

from __future__ import annotations

import math
import textwrap
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

PAPER = "#7f7f7f"  # paper values
CI_ALPHA = 0.2
MIN_WIDTH = 7.5  # inches: room for the title and the caption
LINE_IN = 0.13  # inches per caption line (7 pt)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f")
MODEL_ORDER = ("llama", "qwen", "qwen-1.5b", "gemma", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
               "qwen3-8b", "qwen3-14b", "qwen3-32b", "llama-3.1-8b", "gemma-2-9b", "mistral-7b")
RC = {
    "figure.dpi": 110, "savefig.dpi": 150, "font.size": 9, "axes.titlesize": 9.5,
    "axes.labelsize": 9, "legend.fontsize": 7.5, "xtick.labelsize": 8, "ytick.labelsize": 8,
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.25,
    "pdf.fonttype": 42,
}
plt.rcParams.update(RC)


def colour(key: str, keys: Sequence[str] | None = None) -> str:
    """A fixed colour per model name (others by their index in `keys`)."""
    if key in MODEL_ORDER:
        return PALETTE[MODEL_ORDER.index(key) % len(PALETTE)]
    i = list(keys).index(key) if keys is not None and key in keys else zlib.crc32(key.encode())
    return PALETTE[i % len(PALETTE)]


def models_in(df: pd.DataFrame) -> list[str]:
    """Models of a frame, in the fixed order (unknown names last, sorted)."""
    ms = sorted({str(m) for m in df["model"].dropna().unique()})
    return sorted(ms, key=lambda m: (MODEL_ORDER.index(m) if m in MODEL_ORDER else len(MODEL_ORDER), m))


def panels(n: int, ncols: int | None = None, size: tuple[float, float] = (4.2, 3.1),
           sharey: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure with n panels in a grid (at most 4 per row), as a flat list of axes."""
    ncols = ncols or min(max(n, 1), 4)
    nrows = max(1, math.ceil(n / ncols))
    width = max(size[0] * ncols, MIN_WIDTH)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, size[1] * nrows),
                             squeeze=False, sharey=sharey)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def band(ax: Axes, table: pd.DataFrame, x: str, label: str, col: str, marker: str = "o",
         linestyle: str = "-") -> None:
    """Mean line with markers and a shaded CI band from a ci_table (columns x, mean, lo, hi)."""
    t = table.sort_values(x)
    xs = t[x].to_numpy(dtype=float)
    ax.plot(xs, t["mean"], marker=marker, ms=3.5, lw=1.4, color=col, label=label, linestyle=linestyle)
    lo, hi = t["lo"].to_numpy(dtype=float), t["hi"].to_numpy(dtype=float)
    ok = np.isfinite(lo) & np.isfinite(hi)
    if ok.any():
        ax.fill_between(xs[ok], lo[ok], hi[ok], color=col, alpha=CI_ALPHA, lw=0)


def errorbars(ax: Axes, x: Any, table: pd.DataFrame, col: str, label: str | None = None,
              marker: str = "o") -> None:
    """Points with CI error bars (NaN intervals drawn as bare points)."""
    mean = table["mean"].to_numpy(dtype=float)
    lo, hi = table["lo"].to_numpy(dtype=float), table["hi"].to_numpy(dtype=float)
    err = np.vstack([np.where(np.isfinite(lo), mean - lo, 0), np.where(np.isfinite(hi), hi - mean, 0)])
    ax.errorbar(x, mean, yerr=np.clip(err, 0, None), fmt=marker, color=col, ms=4, capsize=2.5,
                lw=1.1, label=label)


def paper_hline(ax: Axes, y: float, label: str, lo: float | None = None, hi: float | None = None) -> None:
    """A paper value as a grey dashed line (and its range as a grey band)."""
    if lo is not None and hi is not None:
        ax.axhspan(lo, hi, color=PAPER, alpha=0.12, lw=0)
    ax.axhline(y, color=PAPER, ls="--", lw=1, label=label)


def n_range(table: pd.DataFrame, col: str = "n") -> str:
    """'n=4' or 'n=3-6' over a table's rows."""
    ns = [int(v) for v in table[col].dropna()] if col in table else []
    if not ns:
        return "n=0"
    return f"n={min(ns)}" if min(ns) == max(ns) else f"n={min(ns)}-{max(ns)}"


def _short_run(run_id: str) -> str:
    parts = str(run_id).split("/")
    return "/".join(parts[-3:])


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def provenance(df: pd.DataFrame) -> str:
    """Runs a figure was drawn from: run ids, commits, margins (flagging lowered margins)."""
    lines = []
    cols = [c for c in ("run_id", "model", "commit", "dirty", "margin", "model_margin", "task") if c in df]
    for _, r in df[cols].drop_duplicates("run_id").sort_values("run_id").iterrows():
        commit = str(r.get("commit") or "?")[:7] + ("+dirty" if str(r.get("dirty")) == "True" else "")
        task = r.get("task")
        text = f"{_short_run(r['run_id'])} ({'' if pd.isna(task) else f'task {task}, '}commit {commit}"
        m, default = _num(r.get("margin")), _num(r.get("model_margin"))
        if m is not None:
            text += f", margin {m:g}"
            if default is not None and m < default:
                text += f" < model margin {default:g}: DEVELOPMENT RUN, NOT A FINDING"
        lines.append(text + ")")
    return "runs: " + "; ".join(lines) if lines else ""


def finish(fig: Figure, title: str, caption: str, out: Path, stem: str,
           runs: pd.DataFrame | None = None, legend: tuple[list[Any], list[str]] | None = None,
           legend_cols: int = 4) -> list[Path]:
    """Title on top, caption (+ provenance) below the panels; save <out>/<stem>.png and .pdf.

    `legend` (handles, labels): one legend for the whole figure, in a band of its own between the
    panels and the caption, so it never covers data. The figure grows by the height the title,
    legend and caption need, so the panels keep their size.
    """
    w, h = fig.get_size_inches()
    chars = max(60, int(w * 17))
    text = caption + ("\n" + provenance(runs) if runs is not None and len(runs) else "")
    wrapped = "\n".join(textwrap.fill(p, chars) for p in text.split("\n"))
    head = textwrap.fill(title, max(40, int(w * 9)))
    cap_h = LINE_IN * (wrapped.count("\n") + 1) + 0.25
    top_h = 0.28 * (head.count("\n") + 1) + 0.15
    leg_h = 0.2 * math.ceil(len(legend[1]) / legend_cols) + 0.15 if legend else 0.0
    H = h + cap_h + top_h + leg_h
    fig.set_size_inches(w, H)
    fig.tight_layout(rect=(0, (cap_h + leg_h) / H, 1, 1 - top_h / H))
    if legend:
        fig.legend(*legend, loc="upper center", bbox_to_anchor=(0.5, (cap_h + leg_h) / H),
                   ncol=legend_cols, frameon=False, fontsize=8)
    fig.suptitle(head, fontsize=11, fontweight="bold", y=1 - 0.08 / H, va="top")
    fig.text(0.01, 0.08 / H, wrapped, fontsize=7, va="bottom", ha="left", color="#333333")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p)
    plt.close(fig)
    return paths


def ticks_at(ax: Axes, values: Iterable[Any]) -> None:
    """Plain tick labels at exactly these x values (for symlog / log axes of K or lengths)."""
    vs = sorted({float(v) for v in values if pd.notna(v)})
    ax.set_xticks(vs, [f"{v:g}" for v in vs])
    ax.minorticks_off()


def legend(ax: Axes, **kw: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), frameon=False, **kw)


def label_all(axes: Iterable[Axes], xlabel: str, ylabel: str) -> None:
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
