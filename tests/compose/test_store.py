"""The skill store and the transplant path: bit-identical round trips, refusals, exactness."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes.compose import splice as compose
from kvnotes.compose import store
from kvnotes.engine import run
from kvnotes.models.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models on one torch thread (conftest `one_thread`)."""


def _ids(n, seed, vocab=128):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_round_trip_is_bit_identical(tiny, tmp_path):
    blk = compose.prefill_block(tiny, _ids(17, 1))
    path = store.save_block(tmp_path / "b.safetensors", tiny, blk, name="skill", text="hello")
    got = store.load_block(path, tiny)
    assert torch.equal(got.ids, blk.ids)
    for a, b in zip(got.cache.keys + got.cache.values, blk.cache.keys + blk.cache.values):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    info = store.read_info(path)
    assert (info.name, info.length, info.text, info.model) == ("skill", 17, "hello", tiny.name)
    assert not list(tmp_path.glob(".*"))  # written atomically, no temporary left


def test_round_trip_bf16(tmp_path):
    m = tiny_model("qwen2", dtype=torch.bfloat16)
    blk = compose.prefill_block(m, _ids(9, 2))
    got = store.load_block(store.save_block(tmp_path / "b.safetensors", m, blk), m)
    assert got.cache.dtype == torch.bfloat16 and got.cache.max_abs_diff(blk.cache) == 0.0


def test_another_family_is_refused(tmp_path):
    a, b = tiny_model("llama"), tiny_model("qwen3")
    path = store.save_block(tmp_path / "b.safetensors", a, compose.prefill_block(a, _ids(8, 0)))
    with pytest.raises(store.BlockMismatchError, match="model: block 'tiny-llama'") as e:
        store.load_block(path, b)
    assert "rope" in str(e.value) and "weights" in str(e.value)


def test_same_architecture_other_weights_is_refused(tmp_path):
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    path = store.save_block(tmp_path / "b.safetensors", a, compose.prefill_block(a, _ids(8, 0)))
    with pytest.raises(store.BlockMismatchError, match="weights") as e:
        store.load_block(path, b)
    assert "rope" not in str(e.value)


def test_other_rope_configuration_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from kvnotes.models import wrap_model
    from kvnotes.models.tiny import tiny_config

    a = tiny_model("qwen2")
    cfg = tiny_config("qwen2")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 20000.0}
    b = wrap_model(AutoModelForCausalLM.from_config(cfg), name="tiny-qwen2")
    b.hf.load_state_dict(a.hf.state_dict())  # same weights, other rotary base
    path = store.save_block(tmp_path / "b.safetensors", a, compose.prefill_block(a, _ids(8, 0)))
    with pytest.raises(store.BlockMismatchError, match="rope") as e:
        store.load_block(path, b)
    assert "weights" not in str(e.value)


def test_other_dtype_is_refused(tmp_path):
    a = tiny_model("llama")
    path = store.save_block(tmp_path / "b.safetensors", a, compose.prefill_block(a, _ids(8, 0)))
    a.hf.to(torch.bfloat16)  # same weights (fingerprint in fp32), other cache dtype
    with pytest.raises(store.BlockMismatchError, match="dtype: block float32, loaded bfloat16"):
        store.load_block(path, a)


def test_not_a_block_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    m = tiny_model("llama")
    with pytest.raises(store.StoreError, match="not a kvnotes block"):
        store.load_block(tmp_path / "x.safetensors", m)
    with pytest.raises(store.StoreError, match="no stored block"):
        store.load_block(tmp_path / "missing.safetensors", m)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(store.StoreError, match="unreadable"):
        store.load_block(tmp_path / "bad.safetensors", m)


def test_block_names_map_to_distinct_files_in_the_store(tmp_path):
    """Two names never share a file (issue #36: "a/b" and "a_b" did), and a name never leaves
    the store; plain names keep their file name."""
    names = ["a/b", "a_b", "a b", "a~2fb", "a\\b", "../up", ".hidden", "_hidden", "é", "e\u0301"]
    paths = [store.block_path(tmp_path, n) for n in names]
    assert len(set(paths)) == len(names)
    assert all(p.parent == tmp_path and not p.name.startswith(".") for p in paths)
    assert store.block_path(tmp_path, "skill-L512") == tmp_path / "skill-L512.safetensors"
    assert store.block_path(tmp_path, "a/b") == tmp_path / "a~2fb.safetensors"
    with pytest.raises(store.StoreError, match="empty"):
        store.block_path(tmp_path, "")
    with pytest.raises(store.StoreError, match="too long"):
        store.block_path(tmp_path, "/" * 100)


def test_another_process_loads_the_block(tmp_path):
    m = tiny_model("gemma3", seed=3)
    blk = compose.prefill_block(m, _ids(12, 4))
    path = store.save_block(tmp_path / "b.safetensors", m, blk)
    torch.save({"k": blk.cache.keys[2], "v": blk.cache.values[2]}, tmp_path / "ref.pt")
    code = textwrap.dedent(f"""
        import torch
        from kvnotes.compose import store
        from kvnotes.models.tiny import tiny_model
        blk = store.load_block({str(path)!r}, tiny_model("gemma3", seed=3))
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        assert torch.equal(blk.cache.keys[2], ref["k"]) and torch.equal(blk.cache.values[2], ref["v"])
        try:
            store.load_block({str(path)!r}, tiny_model("gemma3", seed=4))
        except store.BlockMismatchError:
            print("refused")
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "refused"


# --- transplant ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seam", [0, 3, 100])
def test_transplant_equals_splice_bit_for_bit(tiny, seam):
    pre = run.prefill(tiny, _ids(13, 0)).cache
    blocks = [compose.prefill_block(tiny, _ids(n, s)) for n, s in ((9, 1), (5, 2), (11, 3))]
    got = compose.transplant(tiny, pre, blocks, seam)
    want = pre
    for b in blocks:
        want = compose.splice(tiny, want, b, min(seam, len(b)))
    # seam 0 moves K/V only (bit for bit); seams > 0 are repaired in one forward, not one per block
    assert got.max_abs_diff(want) <= (0.0 if seam == 0 else ATOL_FP32)
    assert compose.transplant(tiny, None, blocks[0], 0).max_abs_diff(blocks[0].cache) == 0.0


def test_transplant_from_store_seam_full_length_is_full_recompute(tiny, tmp_path):
    prefix, block, q = _ids(21, 0), _ids(15, 1), _ids(6, 2)
    path = store.save_block(tmp_path / "b.safetensors", tiny, compose.prefill_block(tiny, block))
    blk = store.load_block(path, tiny)
    cache = compose.transplant(tiny, run.prefill(tiny, prefix).cache, blk, seam=len(blk))
    full = run.prefill(tiny, torch.cat([prefix, block], 1)).cache
    assert cache.max_abs_diff(full) <= ATOL_FP32
    got = run.extend(tiny, cache, q).logits[0, -1]
    ref = run.full_logits(tiny, torch.cat([prefix, block, q], 1))[0, -1]
    assert (got - ref).abs().max().item() <= ATOL_FP32


def test_transplant_refuses_mixed_dtypes_and_nothing():
    m = tiny_model("llama")
    b = compose.prefill_block(m, _ids(5, 0))
    with pytest.raises(ValueError, match="one dtype"):
        compose.transplant(m, b.cache.to(dtype=torch.bfloat16), b)
    with pytest.raises(ValueError, match="nothing"):
        compose.transplant(m, None, [])


def test_transplanted_cache_works_with_generate():
    m = tiny_model("llama")
    prefix, block, q = _ids(10, 0), _ids(12, 1), _ids(4, 2)
    ids = torch.cat([prefix, block, q], 1)
    ref = m.hf.generate(ids, max_new_tokens=5, do_sample=False)
    blocks = [compose.prefill_block(m, block)]
    exact = compose.transplant(m, run.prefill(m, prefix).cache, blocks, seam=len(block))
    cache = run.extend(m, exact, q[:, :-1]).cache  # generate computes the last token itself
    got = m.hf.generate(ids, past_key_values=cache.to_dynamic(), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, ref)
    approx = compose.transplant(m, run.prefill(m, prefix).cache, blocks, seam=0)
    out = m.hf.generate(ids, past_key_values=approx.to_dynamic(), max_new_tokens=5, do_sample=False)
    assert out.shape == ref.shape and torch.equal(out[:, : ids.shape[1]], ids)


def test_greedy_matches_generate():
    m = tiny_model("qwen2")
    ids = _ids(15, 0)
    ref = m.hf.generate(ids, max_new_tokens=6, do_sample=False)[0, 15:].tolist()
    cache = run.prefill(m, ids[:, :10]).cache
    before = cache.clone()
    toks, first = compose.greedy(m, cache, ids[:, 10:], 6)
    assert toks == ref and int(first.argmax()) == ref[0]
    assert cache.seq_len == 10 and cache.max_abs_diff(before) == 0.0  # decoded into a copy
    j = next((j for j in range(1, len(ref)) if ref[j] not in ref[:j]), None)
    if j is not None:  # stopping at the first new token keeps what came before it
        assert compose.greedy(m, None, ids, 6, stop_ids=[ref[j]])[0] == ref[:j]
    assert compose.greedy(m, None, ids, 6, stop_ids=[ref[0]])[0] == []


@pytest.mark.real
def test_real_llama_store_round_trip_and_exact_seam(llama, tmp_path):
    tok = llama.tokenizer
    prefix = tok("You are a support agent. Follow the policy below.\n").input_ids
    block = tok("Policy: refunds are issued only for orders that have not shipped. "
                "Shipped orders must be escalated to a human.\n", add_special_tokens=False).input_ids
    q = tok("Question: the order has shipped. Next action:", add_special_tokens=False).input_ids
    blk = compose.prefill_block(llama, block)
    path = store.save_block(tmp_path / "policy.safetensors", llama, blk)
    got = store.load_block(path, llama)
    assert got.cache.max_abs_diff(blk.cache) == 0.0 and torch.equal(got.ids, blk.ids)
    ref = run.full_logits(llama, prefix + block + q)[0, -1]
    pre = run.prefill(llama, prefix).cache
    exact = run.extend(llama, compose.transplant(llama, pre, got, len(got)), q).logits[0, -1]
    assert (exact - ref).abs().max().item() <= ATOL_FP32
    with pytest.raises(store.BlockMismatchError, match="model"):
        store.load_block(path, tiny_model("llama"))


def test_staged_read_gives_the_files_tensors_and_metadata(tmp_path):
    """read_staged (one read into one buffer, views by offset; pinned and copied once on CUDA)
    returns what safetensors reads, dtypes and bytes included."""
    from safetensors import safe_open

    from kvnotes.compose.store import read_staged

    m = tiny_model("llama", dtype=torch.bfloat16)
    path = store.save_block(store.block_path(tmp_path, "b"), m, compose.prefill_block(m, torch.arange(5, 42)[None]))
    host, meta, placed = read_staged(path, "cpu")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        assert meta == f.metadata() and set(host) == set(f.keys())
        for name in f.keys():
            ref = f.get_tensor(name)
            assert host[name].dtype == ref.dtype and torch.equal(host[name], ref)
            assert placed[name].data_ptr() == host[name].data_ptr()  # on CPU: no copy


def test_a_full_or_unwritable_store_is_one_store_error_and_leaves_no_tmp(tmp_path, monkeypatch):
    """save_file's SafetensorError (a full disk, a read-only store) used to reach the caller raw."""
    m = tiny_model("llama")
    blk = compose.prefill_block(m, _ids(8, 0))

    def full(tensors, where, metadata=None):
        Path(where).write_bytes(b"partial")
        raise store.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(store, "save_file", full)
    with pytest.raises(store.StoreError, match="cannot write block 'skill' .*No space left on device") as e:
        store.save_block(tmp_path / "skill.safetensors", m, blk, name="skill")
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
    monkeypatch.undo()
    (tmp_path / "file").write_text("")  # a store whose folder cannot be made
    with pytest.raises(store.StoreError, match="cannot write block"):
        store.save_block(tmp_path / "file" / "skill.safetensors", m, blk, name="skill")
