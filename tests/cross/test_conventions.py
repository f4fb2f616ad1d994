"""docs/conventions.md, checked: which calls add special tokens, how long each cache is, the logits'
shapes and dtypes (issue #34). README links the page."""

from pathlib import Path

import pytest
import torch

from kvnotes import EditableCache
from kvnotes.compose import splice
from kvnotes.edit.editable import demo_prompt
from kvnotes.engine import run
from kvnotes.models.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


class Recording:
    """The tiny tokenizer, noting the add_special_tokens of every call (HF's default: True)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, text, add_special_tokens=True, **kw):
        self.calls.append(add_special_tokens)
        return self.inner(text, add_special_tokens=add_special_tokens, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture()
def model():
    m = tiny_model("llama")
    m.tokenizer = Recording(m.tokenizer)
    return m


def _special(model, call) -> bool:
    model.tokenizer.calls.clear()
    call()
    assert model.tokenizer.calls, "the call did not tokenize"
    return all(model.tokenizer.calls)


def test_which_calls_add_special_tokens(model):
    cache = run.prefill(model, [5, 6, 7]).cache
    assert _special(model, lambda: run.prefill(model, "Session: x"))
    assert _special(model, lambda: run.full_logits(model, "Session: x"))
    assert not _special(model, lambda: run.extend(model, cache, "Session: x"))
    assert not _special(model, lambda: EditableCache(model, demo_prompt()))
    assert not _special(model, lambda: splice.prefill_block(model, "Skill: x"))


def test_cache_lengths_and_logit_shapes():
    model = tiny_model("llama")
    ec = EditableCache(model, demo_prompt())
    n, vocab = len(ec.ids), model.config.vocab_size
    step = run.prefill(model, list(ec.ids))
    assert step.cache.seq_len == n and step.logits.shape == (1, 1, vocab) and step.logits.dtype == torch.float32
    assert run.prefill(model, list(ec.ids), all_logits=True).logits.shape == (1, n, vocab)
    r = ec.edit("account_role: admin", "account_role: guest", strategy="full_downstream")
    assert ec.cache.seq_len == n - 1 and r.cache.seq_len == len(r.ids) - 1
    assert r.next_token_logits().shape == (vocab,)
    assert run.extend(model, step.cache, [5]).cache.seq_len == n + 1


def test_readme_links_the_conventions_and_errors_name_them():
    readme = (ROOT / "README.md").read_text()
    assert "](docs/conventions.md)" in readme
    assert (ROOT / "docs" / "conventions.md").is_file()
    from kvnotes.engine.cache import absolute_positions

    with pytest.raises(IndexError, match="docs/conventions.md"):
        absolute_positions([5], 3)
