"""Prompts are data: suites, domains and banks are YAML files read into frozen dataclasses.

A *suite* is one YAML file `templates/<suite>.yaml` (files starting with `_` are shared banks):
its `kind` picks the builder (gated, skills, memory, agents), `domains` names the gated domains
it draws from (`extra_domains` may define new ones inline) and `design` holds the prompt-design
choices that were measured (rule position, few-shot demonstrations, answer prefix). Adding a
suite is dropping one file here, or in a directory passed as `template_dirs`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import string
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

log = logging.getLogger(__name__)
TEMPLATE_DIR = Path(__file__).parent / "templates"
Kind = Literal["gated", "skills", "memory", "agents"]
Variant = Literal["field", "control", "polarity", "trigger"]
KINDS: tuple[str, ...] = ("gated", "skills", "memory", "agents")
VARIANTS: tuple[str, ...] = ("field", "control", "polarity", "trigger")
RULE_POSITIONS = ("policy", "question")


class UnknownSuiteError(KeyError):
    """A suite name with no template file; the message lists the valid names."""

    def __str__(self) -> str:
        return str(self.args[0])


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


@dataclass(frozen=True)
class Design:
    """Prompt-design choices of a suite (each was measured; see the README's table)."""

    rule_position: str = "question"  # policy: last policy line; question: just before the request
    fewshot: int = 2  # demonstrations of the rule (balanced over both values); 0 = none
    answer_prefix: bool = True  # end the prompt with "Next action:" (assistant turn when chat)
    point_to_field: bool = False  # the task line names the field to check (never its value)

    def __post_init__(self) -> None:
        if self.rule_position not in RULE_POSITIONS:
            raise ValueError(f"rule_position {self.rule_position!r}; valid: {RULE_POSITIONS}")
        if self.fewshot < 0 or self.fewshot % 2:
            raise ValueError(f"fewshot must be an even number >= 0, got {self.fewshot}")


@dataclass(frozen=True)
class Suite:
    """A suite file: which builder, which domains, which design, and its default sizes."""

    name: str
    kind: str
    domains: tuple[Domain, ...]
    variant: str = "field"
    design: Design = dataclasses.field(default_factory=Design)
    n_items: int = 48
    length: int = 400
    seed: int = 0
    description: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # kind-specific extras

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"suite {self.name!r}: kind {self.kind!r}; valid: {KINDS}")
        if self.variant not in VARIANTS:
            raise ValueError(f"suite {self.name!r}: variant {self.variant!r}; valid: {VARIANTS}")


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


def _suite_files(template_dirs: Sequence[str | Path] = ()) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for d in (TEMPLATE_DIR, *map(Path, template_dirs)):
        if not d.is_dir():
            raise ValueError(f"template_dirs: {str(d)!r} is not a directory")
        for p in sorted(d.glob("*.yaml")):
            if not p.name.startswith("_"):
                files[p.stem] = p
    return files


def suite_names(template_dirs: Sequence[str | Path] = ()) -> list[str]:
    """Every suite with a template file (built in, plus any in `template_dirs`)."""
    return sorted(_suite_files(template_dirs))


def _select_domains(name: str, data: Mapping[str, Any]) -> tuple[Domain, ...]:
    """The suite's `domains:` (built-in names, or "all"), then its `extra_domains`.

    A suite with `extra_domains` must say whether the built-in ones join them (`domains: all`)
    or not (`domains: []`); a suite without either draws all built-in domains, and says so.
    """
    known = dict(builtin_domains())
    extra = {n: domain_from_dict(n, d) for n, d in (data.get("extra_domains") or {}).items()}
    known.update(extra)
    if "domains" not in data:
        if extra:
            raise ValueError(
                f"suite {name!r} has extra_domains but no `domains:` key; write `domains: []` to draw "
                f"only {sorted(extra)}, or `domains: all` to add the {len(builtin_domains())} built-in ones"
            )
        log.info("suite %r has no `domains:` key: drawing all %d built-in domains", name,
                 len(builtin_domains()))
    wanted = data.get("domains", "all")
    if wanted != "all" and not isinstance(wanted, list):
        raise ValueError(f"suite {name!r}: domains is a list of names or \"all\", got {wanted!r}")
    names = sorted(builtin_domains()) if wanted == "all" else [str(n) for n in wanted]
    names += [n for n in extra if n not in names]  # inline domains are always drawn from
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"suite {name!r}: unknown domains {missing}; valid: {sorted(known)}")
    if not names:
        raise ValueError(f"suite {name!r} draws no domains: list some, or define extra_domains")
    return tuple(known[n] for n in names)


def load_suite(name: str, template_dirs: Sequence[str | Path] = ()) -> Suite:
    """Read `<name>.yaml`; an unknown name raises UnknownSuiteError listing the valid ones."""
    files = _suite_files(template_dirs)
    if name not in files:
        raise UnknownSuiteError(f"unknown task suite {name!r}; valid suites: {', '.join(sorted(files))}")
    data = _read(files[name])
    known = {"kind", "description", "variant", "domains", "extra_domains", "design", "n_items",
             "length", "seed", "options"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"suite {name!r}: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    kind = str(data.get("kind", "gated"))
    suite = Suite(
        name=name,
        kind=kind,
        domains=_select_domains(name, data) if kind == "gated" else (),
        variant=str(data.get("variant", "field")),
        design=Design(**(data.get("design") or {})),
        n_items=int(data.get("n_items", 48)),
        length=int(data.get("length", 400)),
        seed=int(data.get("seed", 0)),
        description=str(data.get("description", "")),
        options=dict(data.get("options") or {}),
    )
    if suite.kind == "gated":
        from kvnotes.tasks.rules import check_rules  # rules reads this module's banks

        check_rules(name, suite.variant, suite.domains)
    return suite


def configured_suite(
    suite: str,
    template_dirs: Sequence[str | Path] = (),
    domains: Sequence[str] | None = None,
    design: Mapping[str, Any] | None = None,
) -> Suite:
    """The suite file, narrowed to `domains` (None: all) and with `design` fields overridden."""
    s = load_suite(suite, template_dirs)
    if domains is not None:
        known = {d.name: d for d in s.domains}
        missing = [n for n in domains if n not in known]
        if missing:
            raise ValueError(f"suite {suite!r} has no domains {missing}; valid: {sorted(known)}")
        s = replace(s, domains=tuple(known[n] for n in domains))
    if design:
        s = replace(s, design=replace(s.design, **dict(design)))
    return s
