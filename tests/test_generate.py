"""`EditResult.generate` / `kvnotes.engine.generation.generate` return a GenerateOutput (issue #34):
new ids, text, scores when asked; several sequences per prompt (sampling or beams) from one cache."""

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
