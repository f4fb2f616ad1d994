"""Shared fixtures: tiny random models of every family (seconds) and the real default model."""

from __future__ import annotations

import os

import pytest
import torch
from tolerances import ATOL_FP32  # noqa: F401  (re-exported for older imports)

from kvnotes.models import FAMILIES, WeightsError, load_model
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request):
    """A tiny random model of each family (4 layers, d=64), fp32."""
    return tiny_model(request.param, seed=0)


@pytest.fixture(scope="session")
def llama():
    """The real default model (SmolLM2-135M-Instruct) in fp32; fetched by the README install."""
    try:
        return load_model("llama", device="cpu", dtype="float32")
    except WeightsError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_llama_vocab():
    """A tiny random llama (4 layers, d=64) over the real llama tokenizer's vocabulary: real
    prompts, seconds per forward (skipped when the llama tokenizer is not fetched)."""
    from transformers import AutoModelForCausalLM

    from kvnotes.models import load_tokenizer, wrap_model
    from kvnotes.models.tiny import tiny_config

    try:
        tok = load_tokenizer("llama")
    except WeightsError as e:
        pytest.skip(str(e))
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return wrap_model(AutoModelForCausalLM.from_config(cfg), tokenizer=tok, name="tiny-llama")


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a shared CPU the OpenMP barriers cost seconds."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
