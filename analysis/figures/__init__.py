"""The paper's figures (its claims as docs/paper.md restates them), one module per figure, drawn
from whatever runs exist.

Each module has NAME (the file stem), TITLE, NEEDS (the runs it reads) and
`make(frame, out) -> [png, pdf]`, where `frame` is the tidy records frame of analysis.load; a
figure without the runs it needs raises `Skip(reason)`, and `build_all` reports it as skipped
with that reason instead of drawing an empty plot.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

log = logging.getLogger(__name__)

FIGURES = (
    "memoization_map",
    "position_strip",
    "layer_recovery",
    "probe_depth",
    "knockout_dose",
    "knockout_heads",
    "edit_frontier",
    "ksweep",
    "seam_repair",
    "ttft_scaling",
    "agent",
    "serving",
    "distance",
    "blend",
    "localize_notes",
)


class Skip(Exception):  # noqa: N818 - it is a verdict, not an error
    """The runs a figure needs are not there; the message says which."""


@dataclass
class Outcome:
    made: dict[str, list[Path]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def module(name: str):  # noqa: ANN201 - a figure module
    if name not in FIGURES:
        raise KeyError(f"unknown figure {name!r}; valid: {', '.join(FIGURES)}")
    return importlib.import_module(f"analysis.figures.{name}")


def build_all(frame: pd.DataFrame, out: Path, only: list[str] | None = None) -> Outcome:
    """Draw every figure (or `only` some) into `out`; skipped and failed ones say why."""
    result = Outcome()
    for name in only or FIGURES:
        mod = module(name)
        try:
            result.made[name] = mod.make(frame, out)
        except Skip as e:
            result.skipped[name] = str(e)
        except Exception as e:  # noqa: BLE001 - one broken figure must not hide the others
            log.debug("figure %s failed:\n%s", name, traceback.format_exc())
            result.failed[name] = f"{type(e).__name__}: {e}"
    return result
