"""`verify_weights: header | full` (issue #36): a bit flipped inside a tensor's data passes the
size-and-header check of an ordinary load and is caught by the full one, and meta.json says which
check ran and where its `weights_sha256` comes from.

The packaged model is faked as in test_integrity.py: a tiny random llama saved and recorded as
`convert` records it, with every file treated as large (`integrity.SMALL = 0`), as a real
model's weights are, so the cheap check hashes none of them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_integrity import PIN, _convert_tiny, _overwrite, _tensor_offset
from tiny_runs import SMALL, hydra_ready, read  # noqa: F401

import runner.main as runner
from kvnotes.models import WeightsError, integrity, load_model, registry
from kvnotes.models.registry import ModelSpec, WheelPart

NOT_REHASHED = "recorded at conversion, not re-hashed at this load"


@pytest.fixture(autouse=True)
def large_files(monkeypatch, one_thread):
    monkeypatch.setattr(integrity, "SMALL", 0)


@pytest.fixture
def fake(monkeypatch):
    """A packaged model 'fake' (family llama) registered for this test only; returns its spec."""
    spec = ModelSpec("fake", "llama", "package", "test", gguf_name="fake.gguf", sha256=PIN,
                     parts=(WheelPart("fake-part1", "1.0", "fake_part1/data/part01.bin"),))
    monkeypatch.setitem(registry._REGISTRY, "fake", spec)
    return spec


def _flip_one_bit(folder: Path) -> None:
    st = folder / "model.safetensors"
    at = _tensor_offset(st, "model.layers.1.mlp.up_proj.weight")
    byte = st.read_bytes()[at]
    _overwrite(st, at, bytes([byte ^ 0x01]))  # the lowest mantissa bit of one fp32 weight


def test_a_flipped_bit_passes_header_and_is_caught_by_full(fake, tmp_path):
    folder = _convert_tiny(fake, tmp_path)
    clean = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    p = load_model("fake", device="cpu", cache=tmp_path, verify_weights="full").provenance()
    assert (p["weights_verified"], p["weights_sha256"]) == ("sha256", clean)
    assert p["weights_sha256_source"] == "re-hashed at this load"
    _flip_one_bit(folder)
    p = load_model("fake", device="cpu", cache=tmp_path).provenance()  # header: the default
    assert (p["weights_verified"], p["weights_sha256"]) == ("size+header", clean)
    assert p["weights_sha256_source"] == NOT_REHASHED  # says plainly: the clean hash, not re-checked
    with pytest.raises(WeightsError, match="model.safetensors: sha256 differs from the one recorded"):
        load_model("fake", device="cpu", cache=tmp_path, verify_weights="full")
    with pytest.raises(ValueError, match="verify_weights='every'; valid: header, full"):
        load_model("fake", device="cpu", cache=tmp_path, verify_weights="every")


def _selfcheck_llama(tmp_path: Path, *overrides: str):
    from hydra import compose

    return compose("config", overrides=["+experiment=selfcheck", "model=llama", "device=cpu", "threads=1",
                                        f"cache_dir={tmp_path / 'cache'}", f"results_dir={tmp_path / 'runs'}",
                                        *SMALL, *overrides])


def test_the_run_records_which_check_ran(tmp_path, monkeypatch):
    folder = _convert_tiny(registry.get_spec("llama"), tmp_path / "cache", positions=8192)
    monkeypatch.delenv("KVNOTES_VERIFY_WEIGHTS", raising=False)
    meta = read(runner.run(_selfcheck_llama(tmp_path)) / "meta.json")["model"]
    assert (meta["weights_verified"], meta["weights_sha256_source"]) == ("size+header", NOT_REHASHED)
    monkeypatch.setenv("KVNOTES_VERIFY_WEIGHTS", "full")  # what scripts/reference_queue.sh sets
    meta = read(runner.run(_selfcheck_llama(tmp_path, "seed=1")) / "meta.json")["model"]
    assert (meta["weights_verified"], meta["weights_sha256_source"]) == ("sha256", "re-hashed at this load")
    _flip_one_bit(folder)
    with pytest.raises(WeightsError, match="sha256 differs"):
        runner.run(_selfcheck_llama(tmp_path, "seed=2", "verify_weights=full"))
