"""Domains and the shared banks: the YAML data a suite is built from, read into frozen dataclasses.

A *domain* is one gated decision (a field, its two values, the outcome each makes correct); the
banks (`templates/_<name>.yaml`) hold rule phrasings, fillers, names and the prompt frame. A YAML
error is one line naming the file and where; format fields are checked against the declared ones.
"""

from __future__ import annotations

import dataclasses
import functools
import string
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TEMPLATE_DIR = Path(__file__).parent / "templates"


@dataclass(frozen=True)
class Domain:
    """One gated decision: `values[i]` of `field` makes `outcomes[i]` the correct action."""

    name: str
    role: str
    field: str
    values: tuple[str, str]
    outcomes: tuple[str, str]
    requests: tuple[str, ...]
    rules: tuple[str, ...] = ()
    fillers: tuple[str, ...] = ()
    distractors: tuple[str, ...] = ()
    context: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.values) != 2 or len(self.outcomes) != 2:
            raise ValueError(f"domain {self.name!r}: exactly two values and two outcomes")
        if len(set(self.values)) != 2 or len(set(self.outcomes)) != 2:
            raise ValueError(f"domain {self.name!r}: values and outcomes must be distinct")
        if not self.requests:
            raise ValueError(f"domain {self.name!r}: at least one request")
        for v in self.values:
            if any(v in o for o in self.outcomes):
                raise ValueError(f"domain {self.name!r}: value {v!r} appears in an outcome word")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what went wrong and where (line and column, 1-based)."""
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())


def _read(path: Path) -> dict[str, Any]:
    """A template file's mapping; a file YAML cannot read safely (a tag such as
    `!!python/object/apply`, broken syntax) is one ValueError line naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: {_yaml_problem(e)}; a template file holds plain YAML (no tags)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a template file holds a mapping")
    return data


def format_problem(template: str, allowed: Collection[str]) -> str | None:
    """Why `template` is not a plain `str.format` template over the names in `allowed`, or None.

    A placeholder is a bare declared name: `{field.__class__}` (attribute access, which
    rendered `<class 'str'>`), `{v0[0]}` (indexing), `{v0!r}` (a conversion), `{v0:>9}` (a
    format spec) and `{0}` are refused, so a template renders only the values it declares.
    """
    valid = " ".join(f"{{{a}}}" for a in allowed)
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as e:
        return f"it is not a format template ({e}); valid placeholders: {valid}"
    for name, conv, spec in fields:
        shown = "{" + name + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") + "}"
        if name in allowed and not conv and not spec:
            continue
        if any(c in name for c in ".["):
            return f"its placeholder {shown} reads an attribute or an index; valid: {valid}"
        if name in allowed:
            return f"its placeholder {shown} converts or formats its value; valid: {valid}"
        return f"it uses an unknown placeholder {name!r} ({shown}); valid: {valid}"
    return None


@functools.cache
def banks() -> dict[str, Any]:
    """The shared banks (_banks.yaml): rule phrasings, fillers, names, prompt frame."""
    return _read(TEMPLATE_DIR / "_banks.yaml")


@functools.cache
def bank(name: str) -> dict[str, Any]:
    """Any shared bank file `_<name>.yaml` (domains, skills, memory)."""
    return _read(TEMPLATE_DIR / f"_{name}.yaml")


CONTEXT_FIELDS = ("name", "num")  # what a domain's context lines are filled with (kvnotes.tasks.gated)


def domain_from_dict(name: str, d: Mapping[str, Any]) -> Domain:
    for key, line in dict(d.get("context") or {}).items():
        problem = format_problem(str(line), CONTEXT_FIELDS)
        if problem:
            raise ValueError(f"domain {name!r}: context {key!r} ({line!r}): {problem}")
    try:
        return Domain(
            name=name,
            role=str(d["role"]),
            field=str(d["field"]),
            values=tuple(str(v) for v in d["values"]),  # type: ignore[arg-type]
            outcomes=tuple(str(o) for o in d["outcomes"]),  # type: ignore[arg-type]
            requests=tuple(d["requests"]),
            rules=tuple(d.get("rules", ())),
            fillers=tuple(d.get("fillers", ())),
            distractors=tuple(d.get("distractors", ())),
            context=dict(d.get("context", {})),
        )
    except KeyError as e:
        raise ValueError(f"domain {name!r} lacks key {e.args[0]!r}") from None


@functools.cache
def builtin_domains() -> dict[str, Domain]:
    return {n: domain_from_dict(n, d) for n, d in bank("domains").items()}


def domain_names() -> list[str]:
    return sorted(builtin_domains())
