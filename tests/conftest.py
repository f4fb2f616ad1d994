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
