"""Registry of runnable probes and experiments, refusing duplicates and naming the valid ones.

A probe is `run(model, items, cfg) -> records` (one dict per item and condition) plus an optional
`summarize(records, cfg) -> dict`; an experiment is `run(ctx) -> records` with the same summary
hook. `experiments.run` looks names up here after Hydra has composed and validated the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["probe", "experiment"]


@dataclass(frozen=True)
class Entry:
    name: str
    kind: Kind
    run: Callable[..., Any]
    summarize: Callable[..., dict[str, Any]] | None
    config_cls: type | None  # typed dataclass for the probe/experiment group, or None
    help: str


_ENTRIES: dict[tuple[Kind, str], Entry] = {}


def register(
    kind: Kind,
    name: str,
    config_cls: type | None = None,
    summarize: Callable[..., dict[str, Any]] | None = None,
    help: str = "",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `@register("probe", "patching", PatchingConfig, summarize=...)`."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        key = (kind, name)
        if key in _ENTRIES:
            raise ValueError(f"{kind} {name!r} is already registered")
        _ENTRIES[key] = Entry(name, kind, fn, summarize, config_cls, help or (fn.__doc__ or "").strip())
        return fn

    return deco


def names(kind: Kind) -> list[str]:
    return sorted(n for k, n in _ENTRIES if k == kind)


def get(kind: Kind, name: str) -> Entry:
    try:
        return _ENTRIES[(kind, name)]
    except KeyError:
        valid = ", ".join(names(kind)) or "(none registered)"
        raise KeyError(f"unknown {kind} {name!r}; valid {kind}s: {valid}") from None
