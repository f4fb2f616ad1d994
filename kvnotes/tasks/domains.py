"""Domains and the shared banks: the YAML data a suite is built from, read into frozen dataclasses.

A *domain* is one gated decision (a field, its two values, the outcome each makes correct); the
banks (`templates/_<name>.yaml`) hold rule phrasings, fillers, names and the prompt frame. A YAML
error is one line naming the file and where; format fields are checked against the declared ones.
A template file is bounded before anything is built from it: at most MAX_FILE_BYTES, no aliases
(an alias bomb expands a few lines into billions of nodes), nesting at most MAX_DEPTH deep,
strings at most MAX_TEXT characters, and a domain's list fields lists of strings.
"""

from __future__ import annotations

import dataclasses
import functools
import string
import unicodedata
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TEMPLATE_DIR = Path(__file__).parent / "templates"
MAX_FILE_BYTES = 1 << 20  # the built-in files hold < 10 kB
MAX_TEXT = 2000  # characters in one string (the longest built-in one has 119)
MAX_DEPTH = 20  # levels of nested mappings and lists (the built-in files use 4)


class _PlainLoader(yaml.SafeLoader):
    """safe_load that refuses aliases: `*name` is an error at its line, never an expansion."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found an alias (*{event.anchor}); template "
                                              "files do not use anchors and aliases", event.start_mark)
        return super().compose_node(parent, index)


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


def bound_problem(data: Any) -> str | None:
    """Why loaded YAML is beyond a template's bounds (a string past MAX_TEXT, nesting past
    MAX_DEPTH), naming where; None when within them."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        x, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{where or 'the top'} is nested more than {MAX_DEPTH} levels deep"
        if isinstance(x, str) and len(x) > MAX_TEXT:
            return f"{where or 'the file'} is a string of {len(x)} characters, more than {MAX_TEXT}"
        if isinstance(x, dict):
            stack += [(k, f"{where}.{str(k)[:40]} (key)", depth + 1) for k in x]
            stack += [(v, f"{where}.{str(k)[:40]}".lstrip("."), depth + 1) for k, v in x.items()]
        elif isinstance(x, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    return None


def _read(path: Path) -> dict[str, Any]:
    """A template file's mapping; a file YAML cannot read safely (a tag such as
    `!!python/object/apply`, an alias, broken syntax) or beyond the bounds is one ValueError line
    naming the file and where."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes; a template file holds at most {MAX_FILE_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_PlainLoader) or {}  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: {_yaml_problem(e)}; a template file holds plain YAML (no tags)") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deep for YAML to read; a template file nests at most "
                         f"{MAX_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a template file holds a mapping")
    problem = bound_problem(data)
    if problem:
        raise ValueError(f"{path}: {problem}")
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


ALLOWED_CONTROLS = "\n\t"


def control_problem(text: str) -> str | None:
    """Why `text` may not enter a prompt: it holds an invisible, bidirectional-override or control
    character (U+202E turns the text after it around on screen, ESC starts a terminal sequence);
    None when it holds none."""
    for c in text:
        if c not in ALLOWED_CONTROLS and unicodedata.category(c) in ("Cc", "Cf", "Co", "Cs", "Cn"):
            return (f"it holds the invisible or control character U+{ord(c):04X} "
                    f"({unicodedata.name(c, 'unnamed')}); write plain visible text")
    return None


LIST_FIELDS = ("values", "outcomes", "requests", "rules", "fillers", "distractors")
TEXT_FIELDS = ("role", "field")


def _type_problem(d: Any) -> str | None:
    """Why a domain's mapping has a field of the wrong type (`requests: hi there` made every
    request one character), or None."""
    if not isinstance(d, Mapping):
        return f"is a mapping of its fields, got {type(d).__name__}"
    for key in LIST_FIELDS:
        v = d.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, str | int | float) for x in v)):
            got = type(v).__name__ if not isinstance(v, list) else "a list holding a non-string"
            return f"{key} is a list of strings, got {got} ({str(v)[:40]!r})"
    for key in TEXT_FIELDS:
        v = d.get(key)
        if v is not None and not isinstance(v, str | int | float):
            return f"{key} is a string, got {type(v).__name__}"
    ctx = d.get("context")
    if ctx is not None and (not isinstance(ctx, Mapping) or not all(isinstance(x, str) for x in ctx.values())):
        return f"context is a mapping of strings, got {str(ctx)[:40]!r}"
    for key in (*TEXT_FIELDS, *LIST_FIELDS, "context"):  # rules: kvnotes.tasks.rules, negation first
        v = d.get(key) if key != "rules" else None
        texts = v.values() if isinstance(v, Mapping) else v if isinstance(v, list) else [v]
        for t in texts:
            problem = control_problem(t) if isinstance(t, str) else None
            if problem:
                return f"{key} {str(t)[:40]!r}: {problem}"
    return None


def domain_from_dict(name: str, d: Mapping[str, Any]) -> Domain:
    problem = _type_problem(d)
    if problem:
        raise ValueError(f"domain {name!r}: {problem}")
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
            requests=tuple(str(r) for r in d["requests"]),
            rules=tuple(str(r) for r in d.get("rules") or ()),
            fillers=tuple(str(r) for r in d.get("fillers") or ()),
            distractors=tuple(str(r) for r in d.get("distractors") or ()),
            context=dict(d.get("context", {})),
        )
    except KeyError as e:
        raise ValueError(f"domain {name!r} lacks key {e.args[0]!r}") from None


@functools.cache
def builtin_domains() -> dict[str, Domain]:
    return {n: domain_from_dict(n, d) for n, d in bank("domains").items()}


def domain_names() -> list[str]:
    return sorted(builtin_domains())
