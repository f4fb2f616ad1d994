"""dtype=auto: the fastest exact-enough dtype for the device, with its reason logged."""

import logging

import pytest
import torch

import kvnotes.measure.timing as timing
from kvnotes.models import resolve_dtype
from kvnotes.models.registry import get_spec


def _bf16(monkeypatch, native: bool, free: int = 64 * 2**30):
    monkeypatch.setattr(timing, "native_bf16", lambda device: native)
    monkeypatch.setattr(timing, "available_bytes", lambda device: free)


def test_explicit_names_are_kept_and_bad_ones_refused():
    assert resolve_dtype("bfloat16", get_spec("llama")) == torch.bfloat16
    with pytest.raises(ValueError, match="valid: auto, float32"):
        resolve_dtype("fp8")


def test_cpu_without_native_bf16_takes_fp32_even_for_bf16_models(monkeypatch, caplog):
    _bf16(monkeypatch, native=False)
    with caplog.at_level(logging.INFO, logger="kvnotes.models.devices"):
        assert resolve_dtype("auto", get_spec("qwen3-8b"), "cpu") == torch.float32
    assert "without native bf16" in caplog.text


def test_cpu_with_native_bf16_takes_bf16_only_for_models_declared_fine_in_it(monkeypatch):
    _bf16(monkeypatch, native=True)
    assert resolve_dtype("auto", get_spec("qwen3-8b"), "cpu") == torch.bfloat16
    assert resolve_dtype("auto", get_spec("llama"), "cpu") == torch.float32


def test_fp32_that_does_not_fit_falls_back_to_bf16(monkeypatch, caplog):
    _bf16(monkeypatch, native=False, free=8 * 2**30)  # 8B x 4 bytes > half of 8 GiB
    with caplog.at_level(logging.INFO, logger="kvnotes.models.devices"):
        assert resolve_dtype("auto", get_spec("llama-3.1-8b"), "cpu") == torch.bfloat16
    assert "would not fit" in caplog.text


def test_gpu_takes_bf16_where_native(monkeypatch):
    _bf16(monkeypatch, native=True)
    assert resolve_dtype("auto", get_spec("llama"), "cuda") == torch.bfloat16
    _bf16(monkeypatch, native=False)
    assert resolve_dtype("auto", get_spec("llama"), "cuda") == torch.float32
