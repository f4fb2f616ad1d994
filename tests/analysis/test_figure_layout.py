"""Layout rules of the figures that a reader looks at (labels that do not collide, shared ticks)."""

from pathlib import Path

import numpy as np
import pytest

from analysis.figures.position_strip import strongest_apart


def test_strongest_labels_keep_their_distance():
    rec = np.zeros(100)
    rec[[10, 11, 12, 50, 90]] = [0.9, 0.8, 0.7, 0.5, 0.4]
    rec[30] = np.nan
    assert strongest_apart(rec, n=3, gap=5) == [10, 50, 90]  # 11 and 12 sit next to 10
    assert strongest_apart(rec, n=3, gap=1) == [10, 11, 12]
    assert len(strongest_apart(rec, n=200, gap=1)) == 100  # NaN positions are ranked last


# --- readable at page width (issue #34), on the committed reference runs ----------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference_frame():
    from analysis import load

    return load.load(ROOT / "results" / "reference", jobs=["knockout", "edit"])


@pytest.fixture
def finished(monkeypatch):
    """The figures a make() draws and saves, kept for inspection after their layout."""
    from analysis import style

    figs, real = [], style.finish
    monkeypatch.setattr(style, "finish", lambda fig, *a, **k: figs.append(fig) or real(fig, *a, **k))
    return figs


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _one_legend_clear_of_the_panels(fig) -> list:
    """The figure's one legend (no legend inside a panel), whose box covers no panel; its entries."""
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert not [ax for ax in axes if ax.get_legend() is not None]
    assert len(fig.legends) == 1
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert not [ax for ax in axes if _overlaps(box, ax.get_window_extent())]
    return fig.legends[0].get_texts()


def test_knockout_figures_have_at_most_six_panels_and_keep_legends_off_the_data(reference_frame, finished, tmp_path):
    """knockout_dose was 20 panels at 2925x2220 with legends over the data: now two figures."""
    from analysis.figures import knockout_dose, knockout_heads

    assert reference_frame.loc[reference_frame["job"] == "knockout", "model"].nunique() == 4
    knockout_dose.make(reference_frame, tmp_path)
    knockout_heads.make(reference_frame, tmp_path)
    for fig in finished:
        assert len([ax for ax in fig.axes if ax.get_visible()]) <= 6
        assert len(_one_legend_clear_of_the_panels(fig)) <= 8
        assert fig.get_size_inches()[0] <= 11.0  # printed at page width: fonts stay >= ~5.5 pt


def test_edit_frontier_has_eight_distinct_legend_colours_and_clips_the_wide_bars(reference_frame, finished, tmp_path):
    """16 legend entries in pale tab20 pairs, and bars from -2 to 9 on the recovery axes, before."""
    from matplotlib.colors import to_rgb

    from analysis.figures import edit_frontier

    edit_frontier.make(reference_frame, tmp_path)
    (fig,) = finished
    texts = _one_legend_clear_of_the_panels(fig)
    assert len(texts) <= 8
    colours = []
    for handle in fig.legends[0].legend_handles:
        c = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()
        colours.append(np.array(to_rgb(c)))
    assert min(np.abs(a - b).sum() for i, a in enumerate(colours) for b in colours[i + 1:]) > 0.25
    recovery = [ax for ax in fig.axes if ax.get_visible() and ax.get_ylabel().startswith("recovery")]
    assert len(recovery) == 2
    for ax in recovery:
        lo, hi = ax.get_ylim()
        assert -1.2 <= lo and hi <= 2.2
    off = [t.get_text() for ax in recovery for t in ax.texts if t.get_text().startswith(("erratum:", "field_erratum:"))]
    assert len(off) >= 2  # the means beyond the axis are written beside their edge markers


def test_localize_figure_reads_the_smallest_held_out_set_from_nested_rows():
    import numpy as np
    import pandas as pd

    from analysis.figures.localize_notes import FALLBACK_K, held_set, layout

    rows = pd.DataFrame({"k": [3, 1, 2, 4], "recovery": [0.9, 0.2, 0.5, 0.95],
                         "added": [[30], [10], [20], [40]]})
    assert held_set(rows, 0.8) == (3.0, [10, 20, 30])  # rows sorted by k; the set nests
    k, top = held_set(rows, 0.99)
    assert np.isnan(k) and top == [10, 20, 30, 40][:FALLBACK_K]
    cells = layout(["ab", "\n", "cd"], width=3)
    assert cells == [(0, 0, "ab"), (0, 2, "\u21b5"), (1, 0, "cd")]  # a newline ends its line
