"""The runnable jobs, found by convention the way analysis.figures finds figures.

A job is one module of probes/ (a probe) or experiments/ (an experiment) that defines

* NAME: the name after `+probe=` / `+experiment=` (by habit the file stem);
* CONFIG: its config dataclass (validated in `__post_init__`), or None;
* run: a probe's `run(model, items, cfg) -> records` (one dict per item and condition), or an
  experiment's `run(ctx) -> records | None` (ctx: experiments.Context);
* summarize (optional): `summarize(records, cfg) -> dict`, summary.json's job-specific part;
* READS_TASK (optional, experiments): True when it builds the task group's items (`ctx.items()`),
  so the runner checks `task.length` against the suite before the model loads (probes always do).

Its help line is HELP, else the first line of the module docstring. Modules without NAME (helpers, the two
command-line entry files of experiments/) are not jobs; names starting with `_` are not read.
Adding a probe is writing one such module (and, optionally, configs/probe/<NAME>.yaml).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

Kind = Literal["probe", "experiment"]
PACKAGES: dict[Kind, str] = {"probe": "probes", "experiment": "experiments"}


@dataclass(frozen=True)
class Entry:
    name: str
    kind: Kind
    run: Callable[..., Any]
    summarize: Callable[..., dict[str, Any]] | None
    config_cls: type | None  # typed dataclass for the probe/experiment group, or None
    help: str
    module: str = ""  # the module that defines it
    reads_task: bool = False  # builds the task group's items: a probe, or an experiment's READS_TASK


_ENTRIES: dict[tuple[Kind, str], Entry] = {}


def entry_of(module: ModuleType, kind: Kind) -> Entry | None:
    """The job a module defines, None for a module that is not a job; a malformed one is refused."""
    name = getattr(module, "NAME", None)
    if name is None:
        return None
    run = getattr(module, "run", None)
    if not isinstance(name, str) or not name or not callable(run):
        raise TypeError(f"{module.__name__}: a job module defines NAME (a non-empty str) and run()")
    summarize = getattr(module, "summarize", None)
    doc = (module.__doc__ or "").strip()
    help_ = getattr(module, "HELP", None) or (doc.splitlines()[0] if doc else "")
    return Entry(name, kind, run, summarize if callable(summarize) else None,
                 getattr(module, "CONFIG", None), help_, module.__name__,
                 reads_task=kind == "probe" or getattr(module, "READS_TASK", False) is True)


def add(entry: Entry) -> None:
    """Record a job once; found again (discover runs per run), the first record stays."""
    key = (entry.kind, entry.name)
    if key in _ENTRIES:
        if _ENTRIES[key].module != entry.module:
            raise ValueError(f"{entry.kind} {entry.name!r} is defined twice: {_ENTRIES[key].module} "
                             f"and {entry.module}")
        return
    _ENTRIES[key] = entry


def discover() -> list[str]:
    """Import every public module of probes/ and experiments/ and record the jobs they define
    (sub-packages, such as `probes.parts` and `experiments.shared`, hold shared parts, not jobs)."""
    found = []
    for kind, package in PACKAGES.items():
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_") or info.ispkg:
                continue
            entry = entry_of(importlib.import_module(f"{package}.{info.name}"), kind)
            if entry is not None:
                add(entry)
                found.append(entry.module)
    return found


def names(kind: Kind) -> list[str]:
    return sorted(n for k, n in _ENTRIES if k == kind)


def get(kind: Kind, name: str) -> Entry:
    try:
        return _ENTRIES[(kind, name)]
    except KeyError:
        valid = ", ".join(names(kind)) or "(none found)"
        raise KeyError(f"unknown {kind} {name!r}; valid {kind}s: {valid}") from None
