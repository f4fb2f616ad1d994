"""Suite files that used to build wrong prompts or fail with a traceback (issue #36): a rule
stated by negation, a placeholder that reads an attribute, a YAML tag."""

from __future__ import annotations

import json
import re

import pytest

from kvnotes.tasks import load_suite

SUITE = """kind: gated
domains: []
extra_domains:
  library:
    role: a library assistant
    field: hold_status
    values: [none, reserved]
    outcomes: [renew, decline]
    requests: ["May I keep this book for two more weeks?"]
{extra}"""


def suite(tmp_path, rules: list[str] = (), context: str = "", head: str = "") -> str:
    extra = ("    rules:\n" + "".join(f'      - "{r}"\n' for r in rules) if rules else "") + context
    (tmp_path / "library.yaml").write_text(head + SUITE.format(extra=extra))
    return "library"


@pytest.mark.parametrize(
    ("rule", "word"),
    [
        ("If {field} is not {v1}, the next action is {o0}. If {field} is not {v0}, the next action is {o1}.", "not"),
        ("If {field} is not {v0}, the next action is {o0}. If {field} is not {v1}, the next action is {o1}.", "not"),
        ("Unless {field} is {v0}, call {o0}. Unless {field} is {v1}, call {o1}.", "Unless"),
        ("If {field} isn't {v0}, call {o0}. If {field} isn't {v1}, call {o1}.", "n't"),
        ("Except when {field} is {v0}, call {o0}; except when {field} is {v1}, call {o1}.", "Except"),
    ],
)
def test_a_rule_stated_by_negation_is_refused_with_the_reason(tmp_path, rule, word):
    """The pairing check reads "is not {v0} ... {o0}" as v0 -> o0: it passes, and the prompt says
    the opposite of the domain. The rule check refuses negations outright."""
    with pytest.raises(ValueError, match=f"states a case by negation \\({word!r}\\)") as e:
        load_suite(suite(tmp_path, [rule]), [tmp_path])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("rule", "bad"),
    [
        ("If {field.__class__} is {v0}, call {o0}. If {field} is {v1}, call {o1}.", "{field.__class__}"),
        ("If {field} is {v0[0]}, call {o0}. If {field} is {v1}, call {o1}.", "{v0[0]}"),
        ("If {field} is {v0!r}, call {o0}. If {field} is {v1}, call {o1}.", "{v0!r}"),
        ("If {field} is {v0:>20}, call {o0}. If {field} is {v1}, call {o1}.", "{v0:>20}"),
        ("If {field} is {0}, call {o0}. If {field} is {v1}, call {o1}.", "{0}"),
        ("If {field} is {v0}, call {o0}. If {field} is {v1}, call {o1}. {trigger}", "{trigger}"),
    ],
)
def test_a_placeholder_other_than_the_declared_ones_is_refused(tmp_path, rule, bad):
    """`{field.__class__}` rendered `<class 'str'>`; only the plain declared names are placeholders."""
    with pytest.raises(ValueError, match="valid: {field} {v0} {v1} {o0} {o1}") as e:
        load_suite(suite(tmp_path, [rule]), [tmp_path])
    assert bad in str(e.value) and "\n" not in str(e.value)


def test_a_context_placeholder_other_than_name_and_num_is_refused(tmp_path):
    context = '    context: {customer: "{name.__class__.__mro__}"}\n'
    with pytest.raises(ValueError, match=r"domain 'library': context 'customer' .*\{name.__class__.__mro__\}"
                                         r".*valid: \{name\} \{num\}"):
        load_suite(suite(tmp_path, context=context), [tmp_path])


def test_a_yaml_tag_is_one_line_naming_the_file_and_line(tmp_path):
    head = "description: !!python/object/apply:os.system ['echo hi']\n"
    with pytest.raises(ValueError) as e:
        load_suite(suite(tmp_path, head=head), [tmp_path])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path / 'library.yaml'}: ")
    assert "python/object/apply" in msg and "line 1" in msg and "plain YAML" in msg


def test_broken_yaml_is_one_line(tmp_path):
    (tmp_path / "library.yaml").write_text("kind: gated\ndomains: [a, b\n")
    with pytest.raises(ValueError, match=r"library.yaml: .*line 3") as e:
        load_suite("library", [tmp_path])
    assert "\n" not in str(e.value)


def test_the_runner_reports_a_yaml_tag_as_one_config_error(tmp_path):
    from kvnotes.errors import ConfigError
    from runner.task_config import GatedTask

    suite(tmp_path, head="description: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="task 'library': .*library.yaml: .*plain YAML") as e:
        GatedTask(name="library", template_dirs=[str(tmp_path)])
    assert "\n" not in str(e.value)


# --- issue 54: negations a reader sees, whatever the code points; what stays ambiguous --------------


@pytest.mark.parametrize(
    ("rule", "word"),
    [
        ("If {field} isn\u2019t {v1}, call {o0}. If {field} isn\u2019t {v0}, call {o1}.", "n't"),  # U+2019
        ("If {field} is anything but {v1}, call {o0}. If {field} is anything but {v0}, call {o1}.", "anything but"),
        ("Apart from {field} {v1}, call {o0}. Apart from {field} {v0}, call {o1}.", "Apart from"),
        ("If {field} is other\u00a0than {v1}, call {o0}. If {field} is other\u00a0than {v0}, call {o1}.",
         "other than"),  # a no-break space
        ("If {field} is no\u200bt {v1}, call {o0}. If {field} is no\u200bt {v0}, call {o1}.", "not"),  # ZWSP
        ("If {field} is n\u043et {v1}, call {o0}. If {field} is n\u043et {v0}, call {o1}.", "not"),  # Cyrillic о
        ("If {field} is \uff4e\uff4f\uff54 {v1}, call {o0}. If {field} is \uff4e\uff4f\uff54 {v0}, call {o1}.",
         "not"),  # fullwidth letters
    ],
)
def test_a_negation_written_with_other_code_points_or_words_is_refused(tmp_path, rule, word):
    """Each of these passed the negation check and the pairing check (the case said backwards)."""
    with pytest.raises(ValueError, match=f"states a case by negation \\({word!r}\\)") as e:
        load_suite(suite(tmp_path, [rule]), [tmp_path])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ("If {field} is {v0}, call {o0}.\u202e If {field} is {v1}, call {o1}.", "U+202E"),  # right-to-left override
        ("If {field} is {v0}, call {o0}.\u001b[2J If {field} is {v1}, call {o1}.", "U+001B"),  # ESC
        ("If {field} is {v0}, call {o0}.\u0007 If {field} is {v1}, call {o1}.", "U+0007"),  # BEL
        ("If {field} is {v0}, c\u0430ll {o0}. If {field} is {v1}, call {o1}.", "mixes Latin letters"),
    ],
)
def test_a_rule_with_invisible_control_or_mixed_script_characters_is_refused(tmp_path, rule, problem):
    text = SUITE.format(extra="    rules:\n      - " + json.dumps(rule) + "\n")
    (tmp_path / "library.yaml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(problem)) as e:
        load_suite("library", [tmp_path])
    assert "\n" not in str(e.value)
