"""On CUDA: the engine's exactness at a bf16 tolerance on tiny models of every family, the
synchronised timers and CUDA peak memory, and one patching probe end to end. Skipped on CPU."""

import pytest
import torch

from kvnotes import tasks
from kvnotes.compose import splice as compose
from kvnotes.engine import run, variants
from kvnotes.engine.cache import patch
from kvnotes.measure import timing
from kvnotes.models import FAMILIES
from kvnotes.models.tiny import tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REL_BF16 = 0.05  # bf16 keeps 8 bits of mantissa; kernels differ in reduction order


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((got.float() - ref.float()).abs().max() <= REL_BF16 * ref.float().abs().max() + 1e-3)


@pytest.fixture(scope="module", params=FAMILIES)
def cuda_tiny(request):
    m = tiny_model(request.param, seed=0, dtype=torch.bfloat16)
    m.hf.to("cuda")
    return m


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", [1, 17, 39, 59])
def test_prefill_then_extend_equals_full_forward(cuda_tiny, split):
    ids = _ids(60, 0)
    full = run.full_logits(cuda_tiny, ids)
    a = run.prefill(cuda_tiny, ids[:, :split], logits_to_keep=0)
    b = run.extend(cuda_tiny, a.cache, ids[:, split:], logits_to_keep=0)
    assert _close(torch.cat([a.logits, b.logits], 1), full)


def test_transplant_with_full_seams_is_the_full_forward(cuda_tiny):
    prefix, q = _ids(9, 1), _ids(5, 2)
    blocks = [compose.prefill_block(cuda_tiny, _ids(n, s)) for n, s in ((8, 3), (12, 4))]
    pre = run.prefill(cuda_tiny, prefix).cache
    got = compose.transplant_extend(cuda_tiny, pre, blocks, 100, q).logits[0, -1]
    ref = run.full_logits(cuda_tiny, torch.cat([prefix, compose.block_ids(blocks), q], 1))[0, -1]
    assert _close(got, ref)


def test_read_variants_equals_materialised_patches(cuda_tiny):
    a = run.prefill(cuda_tiny, _ids(30, 5)).cache
    b = run.prefill(cuda_tiny, _ids(30, 6)).cache
    tail = _ids(2, 7)
    positions = [[0], [7, 9], list(range(10, 30)), []]
    got = variants.read_variants(cuda_tiny, a, b, positions, tail)
    want = torch.cat([run.extend(cuda_tiny, patch(a, b, p), tail, logits_to_keep=0).logits for p in positions])
    assert _close(got, want)


def test_timers_synchronise_and_read_cuda_peak():
    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    with timing.timed(dev, memory=True) as t:
        y = x @ x  # 16 MiB result
    assert t.seconds > 0 and t.peak_mb >= 15 and y.shape == x.shape
    assert timing.available_bytes(dev) > 0


def test_patching_probe_end_to_end():
    from kvnotes.edit.patching import make_pair, patched_scores

    m = tiny_model("llama", seed=0, dtype=torch.bfloat16)
    m.hf.to("cuda")
    item = tasks.build_suite("gated", m.tokenizer, chat=False, n_items=1, length=800, seed=0)[0]
    pair = make_pair(m, item)
    scores = patched_scores(m, pair, [[], list(range(pair.n_cached)), *[[p] for p in pair.field_to_end]])
    assert scores.shape == (2 + len(pair.field_to_end),)
    tol = REL_BF16 * max(abs(pair.score_stale), abs(pair.score_oracle)) + 1e-2
    assert abs(scores[0] - pair.score_stale) <= tol and abs(scores[1] - pair.score_oracle) <= tol


def test_a_block_loaded_to_cuda_is_the_stored_block_and_a_damaged_one_is_refused(cuda_tiny, tmp_path):
    from kvnotes.compose import store

    blk = compose.prefill_block(cuda_tiny, _ids(40, 8))
    path = store.save_block(store.block_path(tmp_path, "b"), cuda_tiny, blk)
    got = store.load_block(path, cuda_tiny, device="cuda")
    assert got.cache.keys[0].device.type == "cuda" and torch.equal(got.ids, blk.ids.cpu())
    for a, b in zip((*got.cache.keys, *got.cache.values), (*blk.cache.keys, *blk.cache.values)):
        assert torch.equal(a, b)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a byte of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(store.BlockDamagedError):
        store.load_block(path, cuda_tiny, device="cuda")


# --- short forwards replayed from a CUDA graph (kvnotes.engine.graphs) ---------------------------


@pytest.mark.parametrize("filled,n", [(40, 1), (25, 12), (40, 7)])  # extend1, an erratum, a question
def test_graphed_extend_equals_the_eager_forward(cuda_tiny, filled, n):
    from kvnotes.engine.cache import buffers
    from kvnotes.engine.graphs import GraphedExtend

    cache = run.prefill(cuda_tiny, _ids(40, 8)).cache
    eager_bufs = buffers(cache, n, 1, cuda_tiny.device)
    graph_bufs = buffers(cache, n, 1, cuda_tiny.device)
    graphed = GraphedExtend(cuda_tiny, *graph_bufs, filled, n, logits_to_keep=n)
    for seed in (9, 10):  # two replays with different ids: the static input is really read
        ids = _ids(n, seed).cuda()
        want = run.extend_into(cuda_tiny, *eager_bufs, filled, ids, logits_to_keep=n)
        got = graphed(ids)
        assert _close(got.logits, want.logits)
        assert _close(torch.stack(got.cache.keys), torch.stack(want.cache.keys))


def test_blocks_attended_in_place_equal_the_transplant(cuda_tiny):
    from kvnotes.compose.inplace import transplant_extend_inplace

    pre = run.prefill(cuda_tiny, _ids(9, 1)).cache
    blocks = [compose.prefill_block(cuda_tiny, _ids(n, s)) for n, s in ((20, 3), (30, 4))]
    q = _ids(5, 2)
    want = compose.transplant_extend(cuda_tiny, pre, blocks, 2, q, logits_to_keep=0)
    got = transplant_extend_inplace(cuda_tiny, pre, blocks, 2, q, logits_to_keep=0)
    assert got.logits is not None and _close(got.logits, want.logits)


def test_host_tier_is_pinned_and_moves_a_block_to_the_device(tmp_path):
    from kvnotes.compose import store, tiers

    m = tiny_model("llama", seed=0, dtype=torch.bfloat16)
    m.hf.to("cuda")
    path = store.save_block(tmp_path / "b.safetensors", m, compose.prefill_block(m, _ids(11, 1)))
    tier = tiers.MemoryTier(m, "host")
    tier.admit(path)
    assert tier.pinned
    blk = tier.get("b")
    assert blk.cache.device.type == "cuda"
    assert blk.cache.max_abs_diff(store.load_block(path, m, device="cuda").cache) == 0.0


def test_the_benchmark_times_graphed_short_forwards():
    from benchmarks import engine_paths

    m = tiny_model("llama", seed=0, dtype=torch.bfloat16)
    m.hf.to("cuda")
    stale = run.prefill(m, _ids(40, 1)).cache
    paths = engine_paths.graph_paths(m, stale, _ids(1, 2).cuda(), 30, _ids(15, 3)[0].tolist())
    assert [p.name for p in paths] == ["extend1_graph", "erratum_graph"]
    assert all(p.fn().logits.shape[-1] == m.config.vocab_size for p in paths)
