"""A suite file written by a user is checked before it is used: rules, domains, outcome words."""

from __future__ import annotations

import logging

import pytest

from kvnotes.tasks import build_suite, domain_names, load_suite, suite_names
from kvnotes.tasks import tokens as tokens_mod
from kvnotes.tasks.domains import Domain
from kvnotes.tasks.rules import fill_rule, rule_problem

LIBRARY = """kind: gated
{domains}extra_domains:
  library:
    role: a library assistant
    field: hold_status
    values: [none, reserved]
    outcomes: [renew, decline]
    requests: ["May I keep this book for two more weeks?"]
{rules}"""


def suite_file(tmp_path, rules: list[str] | None = None, domains: str | None = "[]") -> str:
    rule_lines = "" if rules is None else "    rules:\n" + "".join(f'      - "{r}"\n' for r in rules)
    (tmp_path / "library.yaml").write_text(LIBRARY.format(
        domains="" if domains is None else f"domains: {domains}\n", rules=rule_lines))
    return "library"


LIB = Domain("library", "a library assistant", "hold_status", ("none", "reserved"), ("renew", "decline"),
             ("May I?",))


# --- rules --------------------------------------------------------------------------------------


def test_the_one_sided_rule_of_the_report_is_refused(tmp_path):
    """Swapping its cases made it read 'may be renewed only when hold_status is reserved: answer
    decline' -- a contradiction nobody caught."""
    rule = "Items may be renewed only when {field} is {v0}: answer {o0}."
    assert fill_rule(rule, LIB, order=1) == "Items may be renewed only when hold_status is reserved: answer decline."
    name = suite_file(tmp_path, [rule])
    with pytest.raises(ValueError, match="rule .* renders as .* never names the outcome 'decline'.*state both"):
        load_suite(name, [tmp_path])


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ("Renew only when {field} is {v0}.", "never names the outcome 'renew' or 'decline'"),
        ("If {field} is {v0}, answer {o0}; otherwise answer {o1}.", "never names the value 'reserved'"),
        ("If {field} is {v0}, do {o1}; if {field} is {v1}, do {o0}.", "pairs 'none' with 'decline'"),
        ("Answer {o0} or {o1}; {field} is {v0} or {v1}.", "pairs 'none' with 'decline'"),
        ("If {field} is {v0}, the next action is {o0}. {missing}", "unknown placeholder 'missing'"),
    ],
)
def test_bad_rules_are_refused_with_the_reason(tmp_path, rule, problem):
    with pytest.raises(ValueError, match=problem):
        load_suite(suite_file(tmp_path, [rule]), [tmp_path])


@pytest.mark.parametrize(
    "rule",
    [
        "Loans whose {field} is {v0} get {o0}; loans whose {field} is {v1} get {o1}.",
        "Answer {o0} when {field} is {v0}, and {o1} when {field} is {v1}.",
        "{field} = {v0} -> {o0}; {field} = {v1} -> {o1}.",
    ],
)
def test_two_sided_rules_in_either_form_load(tmp_path, rule):
    suite = load_suite(suite_file(tmp_path, [rule]), [tmp_path])
    assert [d.name for d in suite.domains] == ["library"]


def test_rule_problem_reads_both_orders():
    rule = "If {field} is {v0}, do {o0}; if {field} is {v1}, do {o1}."
    assert rule_problem(fill_rule(rule, LIB, 0), LIB) is None
    assert rule_problem(fill_rule(rule, LIB, 1), LIB) is None
    assert "pairs" in rule_problem("If hold_status is none, do decline; if it is reserved, do renew.", LIB)


def test_every_built_in_suite_passes_its_own_checks():
    for name in suite_names():
        load_suite(name)  # gated suites render every phrasing of every domain, both orders


def test_polarity_rules_are_checked_as_one_sided_by_design():
    rule = "{trigger} {field} is {v0}, the next action is {o0}; otherwise the next action is {o1}."
    text = fill_rule(rule, LIB, 1, trigger="If")
    assert rule_problem(text, LIB, one_sided=True) is None
    assert "never names the value 'none'" in rule_problem(text, LIB)


# --- domains: the default is explicit ---------------------------------------------------------


def test_extra_domains_without_a_domains_key_is_refused(tmp_path):
    name = suite_file(tmp_path, domains=None)
    with pytest.raises(ValueError, match="has extra_domains but no `domains:` key; write `domains: \\[\\]`"):
        load_suite(name, [tmp_path])


def test_domains_empty_list_draws_only_the_suites_own(tmp_path):
    assert [d.name for d in load_suite(suite_file(tmp_path, domains="[]"), [tmp_path]).domains] == ["library"]
    every = load_suite(suite_file(tmp_path, domains="all"), [tmp_path]).domains
    assert [d.name for d in every] == [*domain_names(), "library"]


def test_no_domains_key_and_no_extra_draws_all_and_says_so(tmp_path, caplog):
    (tmp_path / "plain.yaml").write_text("kind: gated\n")
    with caplog.at_level(logging.INFO, logger="kvnotes.tasks.templates"):
        suite = load_suite("plain", [tmp_path])
    assert len(suite.domains) == len(domain_names())
    assert f"drawing all {len(domain_names())} built-in domains" in caplog.text


# --- outcome words read on a common prefix ----------------------------------------------------


def test_outcome_scored_on_a_common_prefix_is_warned_about(qwen_tok, caplog, monkeypatch):
    monkeypatch.setattr(tokens_mod, "_prefix_checked", set())
    with caplog.at_level(logging.WARNING, logger="kvnotes.tasks.tokens"):
        tokens_mod.decision_ids(qwen_tok, ["rebook", "cancel_order"], "Next action:")
    assert "outcome 'rebook' is scored on its first token ' re', a prefix of" in caplog.text
    assert "cancel_order" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvnotes.tasks.tokens"):
        tokens_mod.decision_ids(qwen_tok, ["rebook", "cancel_order"], "Next action:")
    assert caplog.text == ""  # once per tokenizer and outcome


def test_user_suite_with_a_prefix_outcome_builds_and_warns(tmp_path, qwen_tok, caplog, monkeypatch):
    monkeypatch.setattr(tokens_mod, "_prefix_checked", set())
    (tmp_path / "travel.yaml").write_text(
        "kind: gated\ndomains: []\nextra_domains:\n  travel:\n    role: a travel agent\n"
        "    field: seat_status\n    values: [open, full]\n    outcomes: [rebook, cancel_trip]\n"
        "    requests: [\"Can you help with my flight?\"]\n"
    )
    with caplog.at_level(logging.WARNING, logger="kvnotes.tasks.tokens"):
        items = build_suite("travel", qwen_tok, n_items=2, length=300, template_dirs=[tmp_path])
    assert len(items) == 2 and caplog.text.count("outcome 'rebook'") == 1
