"""Suite files are bounded and typed before anything is built from them (issue 54): an alias bomb
ended in MemoryError after 23 s, a 50 MB rule stalled past 90 s, `requests: hi there` made every
request one character, an empty file drew every built-in domain. Each is one line now."""

from __future__ import annotations

import time

import pytest

from kvnotes.tasks import domains as domains_mod
from kvnotes.tasks import load_suite

DOMAIN = """kind: gated
domains: []
extra_domains:
  library:
    role: a library assistant
    field: hold_status
    values: [none, reserved]
    outcomes: [renew, decline]
    requests: {requests}
"""


def _refused(tmp_path, text: str | bytes, match: str, seconds: float = 5.0) -> str:
    path = tmp_path / "library.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as e:
        load_suite("library", [tmp_path])
    assert time.monotonic() - t0 < seconds
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_an_alias_bomb_is_refused_at_its_first_alias(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    bomb = "\n".join(lines) + "\nkind: gated\ndescription: *i\n"
    msg = _refused(tmp_path, bomb, r"found an alias \(\*a\)")
    assert "library.yaml" in msg and "line 2" in msg


def test_a_file_past_the_size_cap_is_refused_before_it_is_parsed(tmp_path):
    rule = "If {field} is {v0}, call {o0}. " * (50_000_000 // 30)  # ~50 MB in one rule string
    text = DOMAIN.format(requests='["Renew?"]') + f'    rules: ["{rule}"]\n'
    _refused(tmp_path, text, f"bytes; a template file holds at most {domains_mod.MAX_FILE_BYTES} bytes")


def test_a_long_string_and_deep_nesting_are_refused(tmp_path):
    text = DOMAIN.format(requests='["Renew?"]') + f'    rules: ["{"x" * 5000}"]\n'
    _refused(tmp_path, text, r"extra_domains.library.rules\[0\] is a string of 5000 characters, more than 2000")
    _refused(tmp_path, "kind: gated\noptions: " + "[" * 30 + "]" * 30 + "\n", "nested more than 20 levels")
    _refused(tmp_path, "kind: gated\noptions: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deep")


@pytest.mark.parametrize(
    ("requests", "match"),
    [("hi there", "requests is a list of strings, got str \\('hi there'\\)"),
     ("{a: b}", "requests is a list of strings, got dict"),
     ("[[nested]]", "requests is a list of strings, got a list holding a non-string")],
)
def test_a_string_where_a_list_belongs_is_refused(tmp_path, requests, match):
    _refused(tmp_path, DOMAIN.format(requests=requests), f"domain 'library': {match}")


@pytest.mark.parametrize(
    ("line", "match"),
    [("design: question", "design is a mapping, got str"),
     ("options: [a, b]", "options is a mapping, got list"),
     ("n_items: lots", "n_items is an integer, got str"),
     ("extra_domains: [library]", "extra_domains is a mapping, got list")],
)
def test_a_suite_key_of_the_wrong_type_is_refused(tmp_path, line, match):
    _refused(tmp_path, f"kind: gated\n{line}\n", f"suite 'library': {match}")


def test_an_empty_suite_file_is_refused_instead_of_drawing_every_domain(tmp_path):
    _refused(tmp_path, "# nothing yet\n", "library.yaml is empty; a suite names at least its kind")


def test_a_control_character_in_a_domain_s_text_is_refused(tmp_path):
    _refused(tmp_path, DOMAIN.format(requests='["Renew \\u202e this?"]'),
             "domain 'library': requests 'Renew \\\\u202e this\\?': it holds the invisible or control character U\\+202E")
