"""What a user sees for input that cannot run (issue #34): a cache of another dtype, chat
messages given to EditableCache, an `old` text that is not in the prompt."""

import pytest
import torch

from kvnotes import EditableCache, EditError
from kvnotes.compose import splice
from kvnotes.edit.editable import demo_prompt
from kvnotes.engine import generation, run
from kvnotes.engine.cache import KVCache
from kvnotes.engine.variants import read_variants
from kvnotes.errors import ConfigError
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_a_bf16_cache_into_an_fp32_model_names_both_dtypes(model):
    cache = run.prefill(model, list(range(5, 25))).cache.to(dtype=torch.bfloat16)
    msg = r"cache is bfloat16 but model 'tiny-llama' runs in float32: convert it with cache.to\(dtype=torch.float32\)"
    with pytest.raises(ConfigError, match=msg) as e:
        run.extend(model, cache, [7])
    assert "\n" not in str(e.value)
    for call in (lambda: run.recompute(model, cache, list(range(5, 25)), [3]),
                 lambda: generation.generate(model, cache, [7], 2),
                 lambda: read_variants(model, cache, cache, [[1]], [7])):
        with pytest.raises(ConfigError, match="cache is bfloat16 but model 'tiny-llama' runs in float32"):
            call()
    ok = run.extend(model, cache.to(dtype=torch.float32), [7])  # the fix the message names
    assert ok.cache.seq_len == 21


def test_a_cache_of_another_model_is_refused(model):
    cache = run.prefill(model, list(range(5, 25))).cache
    with pytest.raises(ConfigError, match="cache has 3 layers but model 'tiny-llama' has 4"):
        run.extend(model, KVCache(cache.keys[:3], cache.values[:3]), [7])


def _chat_model():
    m = tiny_model("llama")
    m.tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                 "{% if add_generation_prompt %}<assistant>{% endif %}")
    return m


def test_chat_messages_go_through_the_chat_template():
    m = _chat_model()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": demo_prompt()}]
    ec = EditableCache(m, chat)
    assert ec.prompt == "<system>Be brief.\n<user>" + demo_prompt() + "\n<assistant>"
    assert ec.prompt == m.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    r = ec.edit("account_role: admin", "account_role: guest", strategy="full_downstream")
    assert r.text.endswith("<assistant>") and "account_role: guest" in r.text


def test_chat_messages_without_a_chat_template_say_so(model):
    with pytest.raises(EditError, match="model 'tiny-llama' has no chat template.*pass the prompt as text"):
        EditableCache(model, [{"role": "user", "content": "hello there"}])
    with pytest.raises(EditError, match="list of {'role': ..., 'content': ...} dicts"):
        EditableCache(_chat_model(), [{"text": "hello there"}])
    with pytest.raises(EditError, match="not int"):
        EditableCache(model, 3)  # type: ignore[arg-type]


def test_old_text_missing_is_not_the_ambiguous_case(model):
    ec = EditableCache(model, demo_prompt())
    with pytest.raises(EditError, match=r"^'superuser' is not in the prompt \(which begins 'Session:") as e:
        ec.edit("superuser", "guest")
    assert "unique" not in str(e.value)
    with pytest.raises(EditError, match=r"'Account_Role:  admin' is not in the prompt \(but "
                                        r"'account_role: admin' is, differing in case or spacing\)"):
        ec.edit("Account_Role:  admin", "account_role: guest")
    with pytest.raises(EditError, match="'account_role' occurs 2 times in the prompt; give a longer, unique text"):
        ec.edit("account_role", "role")
    with pytest.raises(EditError, match="insert_before 'Question:' is not in the prompt"):
        ec.transplant(splice.prefill_block(model, [5, 6]), insert_before="Question:")


@pytest.mark.real
def test_real_chat_messages_equal_the_templated_text(llama):
    chat = [{"role": "user", "content": demo_prompt()}]
    text = llama.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    a, b = EditableCache(llama, chat), EditableCache(llama, text)
    assert a.prompt == b.prompt and a.ids == b.ids and a.cache.max_abs_diff(b.cache) == 0.0
