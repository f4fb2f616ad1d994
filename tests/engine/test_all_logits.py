"""Every position's logits through the engine (issue #34): `all_logits=True` on prefill, extend,
extend_many and recompute_extend, as TransformerLens and a plain HF forward return them."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes.engine import run
from kvnotes.errors import ConfigError
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def test_prefill_and_extend_return_every_position(model):
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = run.full_logits(model, ids)  # [1, 20, vocab]
    step = run.prefill(model, ids[:, :12], all_logits=True)
    assert step.logits.shape == (1, 12, model.config.vocab_size) and step.cache.seq_len == 12
    assert (step.logits - ref[:, :12]).abs().max().item() <= ATOL_FP32
    assert torch.equal(step.logits, run.prefill(model, ids[:, :12], logits_to_keep=0).logits)
    more = run.extend(model, step.cache, ids[:, 12:], all_logits=True)
    assert more.logits.shape[1] == 8 and (more.logits - ref[:, 12:]).abs().max().item() <= ATOL_FP32
    assert run.prefill(model, ids).logits.shape == (1, 1, model.config.vocab_size)  # the default
    many = run.extend_many(model, [step.cache, step.cache], ids[:, 12:], all_logits=True)
    assert many.shape == (2, 8, model.config.vocab_size)
    tail = run.recompute_extend(model, step.cache, ids[:, :12], [3], ids[:, 12:], all_logits=True)
    assert (tail.logits - ref[:, 12:]).abs().max().item() <= ATOL_FP32


def test_a_bad_logits_to_keep_is_one_line(model):
    with pytest.raises(ConfigError, match=r"logits_to_keep=-1: the last k >= 1, or 0 \(all_logits=True\)"):
        run.prefill(model, [5, 6, 7], logits_to_keep=-1)
