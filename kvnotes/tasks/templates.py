"""Prompts are data: suites, domains and banks are YAML files read into frozen dataclasses.

A *suite* is one YAML file `templates/<suite>.yaml` (files starting with `_` are shared banks):
its `kind` picks the builder (gated, skills, memory, agents), `domains` names the gated domains
it draws from (`extra_domains` may define new ones inline) and `design` holds the prompt-design
choices that were measured (rule position, few-shot demonstrations, answer prefix). Adding a
suite is dropping one file here, or in a directory passed as `template_dirs`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kvnotes.errors import KvnotesError
from kvnotes.tasks.domains import (
    TEMPLATE_DIR,
    Domain,
    _read,
    builtin_domains,
    domain_from_dict,
)
from kvnotes.tasks.rules import check_rules

log = logging.getLogger(__name__)
Kind = Literal["gated", "skills", "memory", "agents"]
Variant = Literal["field", "control", "polarity", "trigger"]
KINDS: tuple[str, ...] = ("gated", "skills", "memory", "agents")
VARIANTS: tuple[str, ...] = ("field", "control", "polarity", "trigger")
RULE_POSITIONS = ("policy", "question")


class UnknownSuiteError(KvnotesError, KeyError):
    """A suite name with no template file; the message lists the valid names."""

    def __str__(self) -> str:
        return str(self.args[0])


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


SUITE_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,), "description": (str,), "variant": (str,), "domains": (str, list),
    "extra_domains": (dict,), "design": (dict,), "n_items": (int,), "length": (int,), "seed": (int,),
    "options": (dict,),
}


def suite_type_problem(data: Mapping[str, Any]) -> str | None:
    """Why a suite file's top-level value has the wrong type (a string where a mapping belongs),
    or None; unknown keys are refused separately."""
    for key, types in SUITE_TYPES.items():
        v = data.get(key)
        if v is None:
            continue
        if not isinstance(v, types) or (int in types and isinstance(v, bool)):
            want = " or ".join({str: "a string", list: "a list", dict: "a mapping", int: "an integer"}[t]
                               for t in types)
            return f"{key} is {want}, got {type(v).__name__} ({str(v)[:40]!r})"
    return None


def load_suite(name: str, template_dirs: Sequence[str | Path] = ()) -> Suite:
    """Read `<name>.yaml`; an unknown name raises UnknownSuiteError listing the valid ones."""
    files = _suite_files(template_dirs)
    if name not in files:
        raise UnknownSuiteError(f"unknown task suite {name!r}; valid suites: {', '.join(sorted(files))}")
    data = _read(files[name])
    if not data:
        raise ValueError(f"suite {name!r}: {files[name]} is empty; a suite names at least its kind "
                         "(e.g. `kind: gated` and `domains: all`)")
    known = {"kind", "description", "variant", "domains", "extra_domains", "design", "n_items",
             "length", "seed", "options"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"suite {name!r}: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    problem = suite_type_problem(data)
    if problem:
        raise ValueError(f"suite {name!r}: {problem}")
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
