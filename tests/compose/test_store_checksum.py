"""Stored blocks carry a checksum of their content (XXH3-128; sha256 in format /2): a flipped byte in
K/V, ids or metadata is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvnotes.compose import splice as compose
from kvnotes.compose import store
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def _ids(n, seed, vocab=128):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _flip(path: Path, tensor: str) -> None:
    """Flip one bit in the middle of `tensor`'s data in a safetensors file."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    raw[8 + n + (lo + hi) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("tensor", ["ids", "k.0", "v.3"])
def test_a_flipped_byte_is_refused(tmp_path, tensor):
    m = tiny_model("llama")
    path = store.save_block(tmp_path / "b.safetensors", m, compose.prefill_block(m, _ids(9, 0)))
    _flip(path, tensor)
    with pytest.raises(store.StoreError, match=r"stored block 'b' .* is damaged: .*save it again"):
        store.load_block(path, m)
    assert len(store.load_block(path, m, verify=False)) == 9  # the hash is what refused it


def test_bf16_block_round_trips_with_its_checksum(tmp_path):
    m = tiny_model("qwen2", dtype=torch.bfloat16)
    path = store.save_block(tmp_path / "b.safetensors", m, compose.prefill_block(m, _ids(7, 1)))
    algorithm, _, digest = store.read_info(path).checksum.partition(":")
    assert (algorithm, len(digest)) == ("xxh3_128", 32) and len(store.load_block(path, m)) == 7
    _flip(path, "k.1")
    with pytest.raises(store.BlockDamagedError):
        store.load_block(path, m)


def test_changed_metadata_is_refused(tmp_path):
    m = tiny_model("llama")
    path = store.save_block(tmp_path / "b.safetensors", m, compose.prefill_block(m, _ids(5, 0)), text="hello")
    path.write_bytes(path.read_bytes().replace(b'"hello"', b'"hellp"'))
    with pytest.raises(store.StoreError, match="is damaged"):
        store.load_block(path, m)


def test_block_without_checksum_is_refused(tmp_path):
    from safetensors.torch import save_file

    m = tiny_model("llama")
    blk = compose.prefill_block(m, _ids(5, 0))
    path = store.save_block(tmp_path / "b.safetensors", m, blk)
    meta = {k: v for k, v in store.read_info(path).to_metadata().items() if k != "checksum"}
    tensors = {"ids": blk.ids} | {f"{kv}.{i}": t for kv, ts in (("k", blk.cache.keys), ("v", blk.cache.values))
                                  for i, t in enumerate(ts)}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta | {"format": "kvnotes-block/1"})
    with pytest.raises(store.StoreError, match="older kvnotes .*save it again"):
        store.load_block(tmp_path / "old.safetensors", m)


def _tensors(blk):
    return {"ids": blk.ids} | {f"{kv}.{i}": t.contiguous() for kv, ts in (("k", blk.cache.keys), ("v", blk.cache.values))
                               for i, t in enumerate(ts)}


def test_a_format_2_block_with_sha256_still_loads_and_is_checked(tmp_path):
    from safetensors.torch import save_file

    m = tiny_model("llama")
    blk = compose.prefill_block(m, _ids(6, 2))
    meta = {k: v for k, v in store.read_info(store.save_block(tmp_path / "new.safetensors", m, blk))
            .to_metadata().items() if k != "checksum"} | {"format": "kvnotes-block/2"}
    tensors = _tensors(blk)
    meta["sha256"] = store.content_checksum(tensors, meta, "sha256").removeprefix("sha256:")
    old = tmp_path / "old.safetensors"
    save_file(tensors, str(old), metadata=meta)
    assert store.read_info(old).checksum.startswith("sha256:")
    assert torch.equal(store.load_block(old, m).cache.keys[0], blk.cache.keys[0])
    _flip(old, "v.1")
    with pytest.raises(store.BlockDamagedError):
        store.load_block(old, m)


def test_the_two_checksums_differ_and_an_unknown_one_is_refused(tmp_path):
    m = tiny_model("llama")
    t = _tensors(compose.prefill_block(m, _ids(4, 3)))
    a, b = store.content_checksum(t, {"x": "1"}), store.content_checksum(t, {"x": "1"}, "sha256")
    assert a.startswith("xxh3_128:") and b.startswith("sha256:") and len(b) == len("sha256:") + 64
    assert store.content_checksum(t, {"x": "2"}) != a  # metadata is covered
    with pytest.raises(store.StoreError, match="unknown block checksum"):
        store.content_checksum(t, {}, "md5")
