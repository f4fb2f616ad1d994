"""`wrap_model` on what a user already holds: an nnsight `LanguageModel`, a TransformerLens bridge.

A LanguageModel is unwrapped to its own HF module (kept as `.nnsight`); a TransformerBridge, or an
HF model one was booted over, is refused in one line, because booting rewires the module: its
logits then differ from a fresh copy's (measured below), so kvnotes would not be exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvnotes.engine.run import prefill
from kvnotes.models import wrap_model
from kvnotes.models.tiny import tiny_model


def _ids(n: int = 20) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))


def _word_tokenizer():
    """Word-level `t0 .. t127` with no BOS (TransformerLens would reload a tokenizer to add one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0", pad_token="t3")


@pytest.fixture(scope="module")
def booted():
    """(fresh HF copy, bridge) of tiny llama: the bridge booted over a second copy."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    hf = tiny_model("llama").hf
    fresh, given = copy.deepcopy(hf), copy.deepcopy(hf)
    bridge = TransformerBridge.boot_transformers(
        "kvnotes-tiny-llama", hf_model=given, tokenizer=_word_tokenizer(), device="cpu",
        dtype=torch.float32, hf_config_overrides={"architectures": [type(hf).__name__]})
    return fresh, bridge


def test_booting_rewires_the_hf_model_so_original_model_is_not_exact(booted):
    """Why wrap_model refuses rather than unwraps: `original_model` is no longer the HF model."""
    fresh, bridge = booted
    with torch.no_grad():
        want = fresh(input_ids=_ids(), use_cache=False).logits
        got = bridge.original_model(input_ids=_ids(), use_cache=False).logits
    assert not torch.equal(got, want)
    assert bridge.original_model.config._attn_implementation == "eager" != fresh.config._attn_implementation


def test_a_bridge_is_refused_in_one_line_saying_what_to_pass(booted):
    fresh, bridge = booted
    for given in (bridge, bridge.original_model):
        with pytest.raises(ValueError, match=r"copy.deepcopy of the HF model made before "
                                             r"TransformerBridge.boot_transformers") as e:
            wrap_model(given)
        assert "\n" not in str(e.value)
    wrapped = wrap_model(fresh)  # the copy made before booting is wrapped as it is
    assert wrapped.hf is fresh


def test_an_nnsight_language_model_is_unwrapped_to_its_module():
    from nnsight import LanguageModel

    tiny = tiny_model("llama")
    lm = LanguageModel(tiny.hf, tokenizer=tiny.tokenizer)
    model = wrap_model(lm, name="tiny-llama")
    assert model.hf is tiny.hf and isinstance(model.hf, torch.nn.Module)
    assert model.tokenizer is lm.tokenizer, "the LanguageModel's tokenizer when none is passed"
    assert model.nnsight is lm, "the user's wrapper is .nnsight: one set of modules"
    assert torch.equal(prefill(model, _ids()).logits, prefill(tiny, _ids()).logits)
    with torch.no_grad(), model.nnsight.trace(_ids()):
        logits = model.nnsight.output.logits.save()
    assert torch.equal(logits, tiny.hf(input_ids=_ids()).logits)


def test_something_else_is_refused_in_one_line():
    with pytest.raises(ValueError, match="wrap_model takes an HF causal LM .*, not str"):
        wrap_model("llama")  # type: ignore[arg-type]


def test_load_takes_what_a_user_holds():
    import pytest as _pytest

    import kvnotes as kv
    from kvnotes.models.tiny import tiny_model

    tiny = tiny_model("llama", seed=0)
    assert kv.load(tiny) is tiny  # a LoadedModel as it is
    wrapped = kv.load(tiny.hf, tiny.tokenizer)  # an HF module with its tokenizer
    assert wrapped.hf is tiny.hf and wrapped.tokenizer is tiny.tokenizer
    with _pytest.raises(TypeError, match="apply to a name"):
        kv.load(tiny.hf, dtype="float32")
    with _pytest.raises(Exception, match="no-such-model"):
        kv.load("no-such-model")
