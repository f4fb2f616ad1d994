"""Memory tiers (kvnotes.compose.tiers): a block is verified when it enters a tier and never on
use; damage on disk is refused at entry, damage in a tier after a scrub, each in one line."""

from __future__ import annotations

import pytest
import torch
from test_store_checksum import _flip
from tolerances import ATOL_FP32

from kvnotes.compose import splice as compose
from kvnotes.compose import store, tiers
from kvnotes.compose.inplace import transplant_extend_inplace
from kvnotes.engine import run
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("where", tiers.TIERS)
def test_a_block_from_a_tier_transplants_as_from_disk(tmp_path, model, where):
    blk = compose.prefill_block(model, _ids(11, 1))
    path = store.save_block(tmp_path / "b.safetensors", model, blk, name="b")
    tier = tiers.MemoryTier(model, where)
    assert tier.admit(path) == "b" and "b" in tier and not tier.pinned  # CPU: nothing to pin
    held = tier.get("b")
    assert torch.equal(held.ids, blk.ids) and held.cache.max_abs_diff(blk.cache) == 0.0
    pre, q = run.prefill(model, _ids(5, 0)).cache, _ids(4, 2)
    got = transplant_extend_inplace(model, pre, [held], 2, q).logits
    want = compose.transplant_extend(model, pre, [store.load_block(path, model)], 2, q).logits
    assert got is not None and (got - want).abs().max().item() <= ATOL_FP32


def test_use_from_a_tier_hashes_nothing(tmp_path, model, monkeypatch):
    path = store.save_block(tmp_path / "b.safetensors", model, compose.prefill_block(model, _ids(6, 1)))
    tier = tiers.MemoryTier(model, "host")
    tier.admit(path)
    calls = []
    monkeypatch.setattr(store, "content_checksum", lambda *a, **k: calls.append(1) or "")
    tier.get("b")
    assert not calls


def test_a_damaged_file_is_refused_when_it_enters(tmp_path, model):
    path = store.save_block(tmp_path / "b.safetensors", model, compose.prefill_block(model, _ids(9, 1)))
    _flip(path, "k.1")
    tier = tiers.MemoryTier(model, "device")
    with pytest.raises(store.BlockDamagedError, match="is damaged") as e:
        tier.admit(path)
    assert "\n" not in str(e.value) and "b" not in tier


def test_damage_in_a_tier_is_found_by_a_scrub_and_refused(tmp_path, model):
    path = store.save_block(tmp_path / "b.safetensors", model, compose.prefill_block(model, _ids(9, 1)))
    tier = tiers.MemoryTier(model, "host")
    tier.admit(path)
    assert tier.scrub() == []
    tier.get("b").cache.values[2][0, 0, 3, 1] += 1.0  # a changed value in the held buffer
    assert tier.scrub() == ["b"]
    with pytest.raises(store.BlockDamagedError, match=r"in the host tier is damaged.*admit it again") as e:
        tier.get("b")
    assert "\n" not in str(e.value)
    tier.admit(path)  # the file is intact: entering again heals it
    assert tier.get("b").cache.max_abs_diff(store.load_block(path, model).cache) == 0.0


def test_unknown_names_and_tiers_are_refused(model):
    with pytest.raises(ValueError, match="valid: device, host"):
        tiers.MemoryTier(model, "gpu")
    with pytest.raises(store.StoreError, match="not in the device tier"):
        tiers.MemoryTier(model, "device").get("nope")
