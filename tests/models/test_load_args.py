"""load_model's arguments as users write them: torch dtypes, a device this machine lacks, and the
hub id a registered model was made from (issue #34)."""

import socket

import pytest
import torch

from kvnotes.errors import ConfigError
from kvnotes.models import (
    WeightsError,
    get_spec,
    load_model,
    model_names,
    resolve_device,
    resolve_dtype,
)
from kvnotes.models.registry import aliases_of


@pytest.mark.parametrize("given", [torch.float16, "torch.float16", "float16"])
def test_torch_dtypes_are_accepted(given):
    assert resolve_dtype(given) == torch.float16
    assert resolve_dtype(torch.bfloat16, get_spec("llama"), "cpu") == torch.bfloat16


def test_unknown_dtype_is_a_config_error_listing_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown dtype torch.int8; valid: auto, float32, bfloat16"):
        resolve_dtype(torch.int8)


def test_cuda_without_cuda_is_one_line_before_any_weights(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device 'cuda' asked for, but CUDA is not available") as e:
        load_model("llama", device="cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device(torch.device("cuda:0"))
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_every_packaged_model_answers_to_its_hub_id():
    for name in model_names():
        spec = get_spec(name)
        if spec.source == "package":
            assert spec.aliases, f"{name} has no hub id alias"
        for alias in aliases_of(spec):
            assert get_spec(alias).name == name and get_spec(alias.upper()).name == name
    assert get_spec("HuggingFaceTB/SmolLM2-135M-Instruct").name == "llama"
    assert get_spec("Qwen/Qwen3-0.6B").name == "qwen3-0.6b"


@pytest.mark.real
def test_llama_hub_id_loads_the_local_weights_offline(monkeypatch):
    """No socket may open: the hub id resolves to the packaged, already converted `llama`."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network touched: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    try:
        m = load_model("HuggingFaceTB/SmolLM2-135M-Instruct", device="cpu", dtype=torch.float32)
    except WeightsError as e:  # weights not fetched on this machine
        pytest.skip(str(e))
    assert m.name == "llama" and m.spec is get_spec("llama") and m.dtype == torch.float32
    assert m.provenance()["weights_verified"] in ("size+header", "recorded-now")
