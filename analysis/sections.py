"""The report's sections after the claims: each declares the jobs and summary keys it reads and
registers itself; the report renders the registered sections in their order.

A section is one module `analysis/<name>_section.py` with a `@section(...)` renderer; `discover()`
imports every such module, so a new experiment's section touches nothing else. A section with no
runs to read says so in one line (`missing`), naming the jobs it looked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Inputs:
    """What a section may read: the tidy frame of the runs, the results folder, the figures drawn."""

    frame: pd.DataFrame
    results: Path
    figures: Mapping[str, str] = field(default_factory=dict)  # figure name -> its PNG, relative to the report


@dataclass(frozen=True)
class Section:
    name: str
    order: int  # place in the report, lowest first
    jobs: tuple[str, ...]  # the jobs whose runs it reads
    reads: tuple[str, ...]  # the summary.json keys (or record columns) it reads
    render: Callable[[Inputs], list[str]]


REGISTRY: dict[str, Section] = {}


def section(name: str, order: int, jobs: tuple[str, ...], reads: tuple[str, ...]
            ) -> Callable[[Callable[[Inputs], list[str]]], Callable[[Inputs], list[str]]]:
    """Register a renderer (Inputs -> markdown lines, [] when it has nothing to show); a name or an
    order used twice is refused."""
    def register(render: Callable[[Inputs], list[str]]) -> Callable[[Inputs], list[str]]:
        if name in REGISTRY or any(s.order == order for s in REGISTRY.values()):
            raise ValueError(f"report section {name!r} (order {order}) is registered twice")
        REGISTRY[name] = Section(name, order, jobs, reads, render)
        return render
    return register


def discover() -> list[Section]:
    """Import every analysis/*_section.py and return the registered sections in order."""
    for path in sorted(ROOT.glob("*_section.py")):
        importlib.import_module(f"analysis.{path.stem}")
    return sorted(REGISTRY.values(), key=lambda s: s.order)


def missing(s: Section, inputs: Inputs) -> str:
    return f"_{s.name}: no runs of {', '.join(s.jobs)} under `{inputs.results}`._"


def render_all(inputs: Inputs) -> list[str]:
    """The lines of every registered section, or its one-line `missing` note."""
    out: list[str] = []
    for s in discover():
        lines = s.render(inputs)
        out += lines if lines else [missing(s, inputs), ""]
    return out
