"""The report's sections register themselves, declare what they read, and say when they have no runs."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from analysis import sections

ROOT = Path(__file__).resolve().parents[2]


def test_every_section_module_registers_one_section_in_order():
    found = sections.discover()
    modules = sorted(p.stem for p in (ROOT / "analysis").glob("*_section.py"))
    assert len(found) == len(modules) and [s.order for s in found] == sorted(s.order for s in found)
    assert all(s.jobs and s.reads for s in found)


def test_the_report_renders_the_registry_not_sections_by_hand():
    text = (ROOT / "analysis" / "report.py").read_text()
    called = set(re.findall(r"\b(\w+_section)\(", text)) - {"runs_section", "dirty_section"}
    assert not called, f"report.py calls sections by hand: {sorted(called)}"


def test_a_section_without_runs_says_so_in_one_line(tmp_path):
    lines = sections.render_all(sections.Inputs(pd.DataFrame(), tmp_path))
    notes = [ln for ln in lines if ln.startswith("_") and "no runs of" in ln]
    assert len(notes) == len(sections.discover())  # an empty results folder: every section says it


def test_a_name_or_order_registered_twice_is_refused():
    s = sections.discover()[0]
    with pytest.raises(ValueError, match="registered twice"):
        sections.section(s.name, 10_000, ("x",), ("y",))(lambda inputs: [])
