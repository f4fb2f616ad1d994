"""Layout rules of the figures that a reader looks at (labels that do not collide, shared ticks)."""

import numpy as np

from analysis.figures.position_strip import strongest_apart


def test_strongest_labels_keep_their_distance():
    rec = np.zeros(100)
    rec[[10, 11, 12, 50, 90]] = [0.9, 0.8, 0.7, 0.5, 0.4]
    rec[30] = np.nan
    assert strongest_apart(rec, n=3, gap=5) == [10, 50, 90]  # 11 and 12 sit next to 10
    assert strongest_apart(rec, n=3, gap=1) == [10, 11, 12]
    assert len(strongest_apart(rec, n=200, gap=1)) == 100  # NaN positions are ranked last
