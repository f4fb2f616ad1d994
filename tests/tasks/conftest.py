"""Tokenizers of every registered model that can be loaded here (packaged ones always)."""

from __future__ import annotations

import functools
import os

import pytest

from kvnotes.models import WeightsError, get_spec, load_tokenizer, model_names


@functools.cache
def _load(name: str):
    return load_tokenizer(name)


def _tokenizer(name: str):
    """The README's test command fetches every packaged tokenizer (`fetch --tokenizer-only all`);
    outside CI a missing one skips with the fetch command, in CI it fails."""
    try:
        return _load(name)
    except WeightsError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


def _available(name: str) -> bool:
    """Packaged tokenizers always; hub ones only when already in the local HF cache."""
    spec = get_spec(name)
    if spec.source == "package":
        return True
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(str(spec.hub_id), "tokenizer_config.json"), str)


TOKENIZERS = [n for n in model_names() if _available(n)]


@pytest.fixture(scope="session", params=TOKENIZERS)
def named_tok(request):
    """(model name, tokenizer, chat) for every registered model whose tokenizer loads here."""
    name = request.param
    tok = _tokenizer(name)
    return name, tok, get_spec(name).chat


@pytest.fixture(scope="session")
def qwen_tok():
    return _tokenizer("qwen")


@pytest.fixture(scope="session")
def gemma_tok():
    return _tokenizer("gemma")
