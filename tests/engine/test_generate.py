"""`EditResult.generate` / `kvnotes.engine.generation.generate` return a GenerateOutput (issue #34):
new ids, text, scores when asked; several sequences per prompt (sampling or beams) from one cache."""

from dataclasses import replace

import pytest
import torch

from kvnotes import EditableCache
from kvnotes.edit.editable import demo_prompt
from kvnotes.engine import run
from kvnotes.engine.generation import GenerateOutput, generate
from kvnotes.errors import ConfigError
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def edited():
    ec = EditableCache(tiny_model("llama"), demo_prompt())
    return ec.edit("account_role: admin", "account_role: guest", strategy="full_downstream")


def test_greedy_output_has_ids_text_and_scores(edited):
    tok = edited.model.tokenizer
    out = edited.generate(max_new_tokens=5, output_scores=True)
    assert isinstance(out, GenerateOutput) and out.ids.shape == (1, 5)
    assert out.sequences[0, : len(edited.ids)].tolist() == list(edited.ids)
    assert str(out) == out.text == tok.decode(out.ids[0], skip_special_tokens=True) == out.texts[0]
    assert out.scores is not None and out.scores.shape == (1, 5, edited.model.config.vocab_size)
    assert out.scores[0].argmax(-1).tolist() == out.ids[0].tolist()  # greedy: the top score each step
    assert out.logits is None and edited.generate(max_new_tokens=2).scores is None
    assert repr(out).startswith("GenerateOutput(") and "new_tokens=5" in repr(out)
    # the same continuation as the plain forward over the whole text, token by token
    seq, cache = list(edited.ids), run.prefill(edited.model, list(edited.ids[:-1])).cache
    for t in out.ids[0].tolist():
        step = run.extend(edited.model, cache, seq[cache.seq_len :])
        assert int(step.logits[0, -1].argmax()) == t
        cache, seq = step.cache, seq + [t]


def test_several_sequences_per_prompt(edited):
    before = edited.cache.clone()
    torch.manual_seed(0)
    out = edited.generate(max_new_tokens=4, do_sample=True, num_return_sequences=3, output_logits=True)
    assert out.ids.shape == (3, 4) and len(out.texts) == 3
    assert out.logits is not None and out.logits.shape[:2] == (3, 4)
    beams = edited.generate(max_new_tokens=4, num_beams=3, num_return_sequences=2)
    assert beams.ids.shape == (2, 4)
    assert edited.cache.max_abs_diff(before) == 0.0, "generate must not change the cache"


def test_greedy_with_several_sequences_says_what_works(edited):
    with pytest.raises(ConfigError, match=r"num_return_sequences=2 needs do_sample=True .* or num_beams >= 2"):
        edited.generate(max_new_tokens=2, num_return_sequences=2)


def test_engine_generate_without_a_tokenizer_still_gives_ids():
    from kvnotes.models import wrap_model

    m = wrap_model(tiny_model("qwen2").hf)  # no tokenizer
    cache = run.prefill(m, [5, 6, 7, 8]).cache
    out = generate(m, cache, [5, 6, 7, 8, 9], 3, do_sample=False)
    assert out.ids.shape == (1, 3) and "ids=" in repr(out)


# --- generation arguments read as Hugging Face reads them (issue #49) ------------------------------
def test_max_length_counts_the_prompt_as_in_hugging_face(edited):
    n = len(edited.ids)
    out = edited.generate(max_length=n + 5)
    assert out.ids.shape == (1, 5), "max_length is prompt + new tokens, not lost to the default 16"
    assert torch.equal(out.ids, edited.generate(max_new_tokens=5).ids)
    assert edited.generate().ids.shape == (1, 16), "neither given: 16 new tokens, as before"
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=3, do_sample=False)
    assert edited.generate(generation_config=cfg).ids.shape == (1, 3)
    with pytest.raises(ConfigError, match="give max_new_tokens .* or max_length .*, not both"):
        edited.generate(max_new_tokens=4, max_length=n + 5)
    with pytest.raises(ConfigError, match=f"max_length={n} counts the prompt's {n} tokens too"):
        edited.generate(max_length=n)


def test_return_dict_in_generate_false_is_refused_in_one_line(edited):
    assert edited.generate(max_new_tokens=2, return_dict_in_generate=True).ids.shape == (1, 2)
    with pytest.raises(ConfigError, match="return_dict_in_generate=False .* whose .sequences is the tensor"):
        edited.generate(max_new_tokens=2, return_dict_in_generate=False)


def test_stop_strings_use_the_models_tokenizer(edited):
    tok = edited.model.tokenizer
    free = edited.generate(max_new_tokens=8).ids[0].tolist()
    stop = tok.decode(free[2:4])  # the text of the third and fourth new tokens
    out = edited.generate(max_new_tokens=8, stop_strings=[stop])
    got = out.ids[0].tolist()
    assert len(got) <= 4 and got == free[: len(got)] and tok.decode(got).endswith(stop)
    from kvnotes.models import wrap_model

    bare = wrap_model(edited.model.hf)  # no tokenizer
    cache = run.prefill(bare, [5, 6, 7, 8]).cache
    with pytest.raises(ConfigError, match="stop_strings needs a tokenizer"):
        generate(bare, cache, [5, 6, 7, 8, 9], 3, stop_strings=["x"])


def test_lengths_past_the_models_positions_are_refused_in_one_line(edited):
    """load_model sets max_positions from the config (a tiny model has none: set here)."""
    n, limit = len(edited.ids), 200
    bounded = replace(edited, model=replace(edited.model, max_positions=limit))
    assert bounded.generate(max_new_tokens=limit - n).ids.shape[1] <= limit - n
    for kwargs in ({"max_new_tokens": 10**9}, {"max_length": limit + 1}):
        with pytest.raises(ConfigError, match=f"after the prompt's {n} tokens passes the {limit} positions "
                                              f"of model 'tiny-llama' .*; use max_new_tokens <= {limit - n}"):
            bounded.generate(**kwargs)


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_bad_counts_are_refused_in_one_line(edited, bad):
    with pytest.raises(ConfigError, match=f"num_return_sequences must be an int >= 1, got {bad}"):
        edited.generate(max_new_tokens=2, do_sample=True, num_return_sequences=bad)
    with pytest.raises(ConfigError, match=f"max_new_tokens must be an int >= 1, got {bad}"):
        edited.generate(max_new_tokens=bad)
