"""A claim's band and the verdict on our interval against it, in plain words: *consistent* (our
CI inside the band), *overlaps* (it only overlaps), *differs* (wholly outside), after a recovery
CI within one score step of the run's dtype of zero is read as zero."""

from __future__ import annotations

import math
from typing import Any


def band(target: dict[str, Any] | None) -> tuple[float, float] | None:
    """The claim as an interval: approx v +- tol, range [lo, hi], at_most, at_least."""
    if not target:
        return None
    if "approx" in target:
        v, tol = float(target["approx"]), float(target.get("tol", 0.0))
        return (v - tol, v + tol)
    if "range" in target:
        lo, hi = target["range"]
        return (float(lo), float(hi))
    if "at_most" in target:
        return (-math.inf, float(target["at_most"]))
    if "at_least" in target:
        return (float(target["at_least"]), math.inf)
    raise ValueError(f"unknown target {target}")


def verdict(target: dict[str, Any] | None, mean: float, lo: float, hi: float, n: int,
            zero_eps: float | None = None) -> str:
    """Plain words: consistent (CI inside the band) / overlaps (CI overlaps it) / differs (CI
    outside it) / no data. `zero_eps`: one score step of the run's dtype (bfloat16: 1/16 logit)
    in the value's units; a CI within it of 0 is read as zero (never as non-zero) before it is
    compared with the band."""
    if n == 0:
        return "no data"
    if not math.isfinite(mean):
        return "differs: undefined for ours (see note)"
    b = band(target)
    if b is None:
        return "for reference (no band)"
    has_ci = math.isfinite(lo) and math.isfinite(hi)
    lo_, hi_ = (lo, hi) if has_ci else (mean, mean)
    caveat = "" if has_ci else " (n=1, no CI)"
    if zero_eps is not None and math.isfinite(zero_eps) and has_ci and -zero_eps <= lo and hi <= zero_eps:
        within = f"zero within one score step of its dtype (+-{zero_eps:.3g})"
        return f"consistent: {within}" if b[0] <= 0.0 <= b[1] else f"differs: ours is {within}"
    if hi_ < b[0]:
        return f"differs: ours is lower{caveat}"
    if lo_ > b[1]:
        return f"differs: ours is higher{caveat}"
    if has_ci and b[0] <= lo and hi <= b[1]:
        return "consistent"
    width = b[1] - b[0]
    if has_ci and math.isfinite(width) and width > 0 and (hi - lo) > 4 * width:
        return "overlaps: CI much wider than the band"
    return f"overlaps{caveat}"
