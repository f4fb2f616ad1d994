"""Cross-check the kvnotes engine against TransformerLens' `TransformerBridge` on the same weights.

The bridge re-implements attention step by step (projections, RoPE, GQA, sliding masks, soft-caps)
instead of calling the HF attention kernel, so agreement is an independent check of the cache
engine. Two claims are tested, in fp32 to 1e-4:

* continuation: `prefill(ids[:n])` then `extend(ids[n:])` gives the bridge's full-sequence logits;
* K/V patch: `cache.patch(A, B, positions, layers)` then `extend(last tokens)` equals one bridge
  forward of A whose prefix K and V are hooked to the clean-A values everywhere except
  (layers, positions), which get B's. Freezing the rest of the prefix is what a patched *cache*
  means: the prefix was computed before the patch, so only the new tokens read it. (Plain
  activation patching would also let later prefix positions see the patch and change their
  K/V in deeper layers; it agrees with the cache patch only on the last layer, tested below.)

K can be hooked after RoPE (`hook_rot_k`, what the cache stores) or before it (`hook_k`, the
projection output; before qk-norm too): at unchanged positions the rotation (and the per-token
norm) is the same for A and B, so both hooks must give the same result.

The bridge is booted from a deep copy of the HF module (booting rewires the module it gets) with
the tokenizer passed in, so nothing is looked up on the hub.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine.cache import patch
from kvnotes.engine.run import extend, prefill
from kvnotes.models import FAMILIES
from kvnotes.models.loading import LoadedModel
from kvnotes.models.tiny import tiny_model

ATOL = 1e-4  # fp32
KVStore = dict[tuple[int, str], Float[Tensor, "batch pos kv_head d_head"]]


# --- helpers -------------------------------------------------------------------------------------
def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer `t0 .. t{n-1}` built in memory (the bridge wants one; no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no BOS token: TransformerLens would otherwise reload the tokenizer by name to add one
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0", pad_token="t3")


def boot_bridge(model: LoadedModel, tokenizer):
    """A TransformerBridge over a deep copy of `model.hf` (the original is left untouched)."""
    from transformer_lens.model_bridge import TransformerBridge

    hf = copy.deepcopy(model.hf)
    return TransformerBridge.boot_transformers(
        f"kvnotes-{model.name}",
        hf_model=hf,
        tokenizer=tokenizer,
        device=str(model.device),
        dtype=model.dtype,
        # tiny configs built with from_config carry no `architectures`; gemma3_text has no alias
        hf_config_overrides={"architectures": [type(model.hf).__name__]},
    )


def bridge_kv(bridge, ids: Int[Tensor, "batch pos"], k_hook: str) -> KVStore:
    """Every layer's K (at `k_hook`) and V, as the bridge hooks see them: [batch pos kv_head d_head]."""
    store: KVStore = {}

    def save(key: tuple[int, str]):
        def fn(t: Tensor, hook) -> None:
            store[key] = t.detach().clone()

        return fn

    hooks = []
    for i in range(bridge.cfg.n_layers):
        hooks.append((f"blocks.{i}.attn.{k_hook}", save((i, "k"))))
        hooks.append((f"blocks.{i}.attn.hook_v", save((i, "v"))))
    with torch.no_grad():
        bridge.run_with_hooks(ids, return_type="logits", fwd_hooks=hooks)
    return store


def bridge_patched_cache_logits(
    bridge,
    ids_a: Int[Tensor, "1 pos"],
    ids_b: Int[Tensor, "1 pos"],
    positions: Sequence[int],
    layers: Sequence[int],
    tail: int,
    k_hook: str = "hook_rot_k",
) -> Float[Tensor, "1 tail vocab"]:
    """The cache-patch semantics written with TransformerLens hooks only (see module docstring)."""
    kv_a, kv_b = bridge_kv(bridge, ids_a, k_hook), bridge_kv(bridge, ids_b, k_hook)
    prefix = ids_a.shape[1] - tail
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    chosen = set(layers)

    def write(key: tuple[int, str]):
        def fn(t: Tensor, hook) -> Tensor:
            frozen = kv_a[key][:, :prefix].clone()  # [1, prefix, kv_head, d_head]
            if key[0] in chosen:
                frozen[:, pos] = kv_b[key][:, pos]
            out = t.clone()
            out[:, :prefix] = frozen
            return out

        return fn

    hooks = []
    for i in range(bridge.cfg.n_layers):
        hooks.append((f"blocks.{i}.attn.{k_hook}", write((i, "k"))))
        hooks.append((f"blocks.{i}.attn.hook_v", write((i, "v"))))
    with torch.no_grad():
        logits = bridge.run_with_hooks(ids_a, return_type="logits", fwd_hooks=hooks)
    return logits[:, prefix:].float()


def engine_patched_cache_logits(
    model: LoadedModel,
    ids_a: Int[Tensor, "1 pos"],
    ids_b: Int[Tensor, "1 pos"],
    positions: Sequence[int],
    layers: Sequence[int],
    tail: int,
) -> Float[Tensor, "1 tail vocab"]:
    prefix = ids_a.shape[1] - tail
    cache_a = prefill(model, ids_a[:, :prefix]).cache
    cache_b = prefill(model, ids_b[:, :prefix]).cache
    patched = patch(cache_a, cache_b, positions, layers)
    return extend(model, patched, ids_a[:, prefix:], logits_to_keep=tail).logits


def random_ids(n: int, seed: int, vocab: int = 128) -> Int[Tensor, "1 pos"]:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- tiny random models (fast) --------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def tiny_pair(request):
    model = tiny_model(request.param)
    attn_before = model.hf.config._attn_implementation
    bridge = boot_bridge(model, tiny_tokenizer(model.config.vocab_size))
    assert model.hf.config._attn_implementation == attn_before, "booting touched the original"
    return model, bridge


def test_bridge_matches_hf_forward(tiny_pair):
    model, bridge = tiny_pair
    ids = random_ids(40, seed=1)
    with torch.no_grad():
        ours = model.hf(input_ids=ids, use_cache=False).logits.float()
        theirs = bridge(ids, return_type="logits").float()
    assert (ours - theirs).abs().max().item() <= ATOL


@pytest.mark.parametrize("split", [7, 30])
def test_continuation_matches_bridge(tiny_pair, split):
    """40 tokens: longer than the tiny sliding windows (24), so cached sliding masks are exercised."""
    model, bridge = tiny_pair
    ids = random_ids(40, seed=2)
    with torch.no_grad():
        theirs = bridge(ids, return_type="logits").float()[:, split:]
    first = prefill(model, ids[:, :split])
    ours = extend(model, first.cache, ids[:, split:], logits_to_keep=0).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= ATOL
    with torch.no_grad():
        theirs_prefix = bridge(ids[:, :split], return_type="logits").float()[:, -1]
    assert (first.logits[:, -1] - theirs_prefix).abs().max().item() <= ATOL


def test_cache_layout_matches_bridge_hooks(tiny_pair):
    """The cache holds post-RoPE K and V, [batch kv_head pos d_head]; the hooks [batch pos kv_head d_head]."""
    model, bridge = tiny_pair
    ids = random_ids(30, seed=3)
    cache = prefill(model, ids).cache
    kv = bridge_kv(bridge, ids, "hook_rot_k")
    for i in range(model.n_layers):
        assert (cache.keys[i] - kv[(i, "k")].transpose(1, 2)).abs().max().item() <= ATOL
        assert (cache.values[i] - kv[(i, "v")].transpose(1, 2)).abs().max().item() <= ATOL


@pytest.mark.parametrize("k_hook", ["hook_rot_k", "hook_k"])
@pytest.mark.parametrize(
    "positions,layers,tail",
    [([3, 7, 20], [1, 2], 1), ([0, 5, 28, 29], [0, 3], 3)],
)
def test_kv_patch_matches_bridge_hooks(tiny_pair, k_hook, positions, layers, tail):
    model, bridge = tiny_pair
    ids_a, ids_b = random_ids(33, seed=4), random_ids(33, seed=5)
    ours = engine_patched_cache_logits(model, ids_a, ids_b, positions, layers, tail)
    theirs = bridge_patched_cache_logits(bridge, ids_a, ids_b, positions, layers, tail, k_hook)
    assert ours.shape == theirs.shape == (1, tail, model.config.vocab_size)
    assert (ours - theirs).abs().max().item() <= ATOL
    clean = extend(model, prefill(model, ids_a[:, :-tail]).cache, ids_a[:, -tail:], tail).logits
    assert (ours - clean).abs().max().item() > 20 * ATOL, "the patch changed nothing: vacuous test"


def test_last_layer_cache_patch_is_plain_activation_patch(tiny_pair):
    """On the last layer nothing downstream reads prefix K/V, so plain TL K/V patching agrees."""
    model, bridge = tiny_pair
    ids_a, ids_b = random_ids(25, seed=6), random_ids(25, seed=7)
    last, positions = model.n_layers - 1, [2, 9, 15]
    kv_b = bridge_kv(bridge, ids_b, "hook_rot_k")
    pos = torch.as_tensor(positions)

    def put(name: str):
        def fn(t: Tensor, hook) -> Tensor:
            out = t.clone()
            out[:, pos] = kv_b[(last, name)][:, pos]
            return out

        return fn

    hooks = [(f"blocks.{last}.attn.hook_rot_k", put("k")), (f"blocks.{last}.attn.hook_v", put("v"))]
    with torch.no_grad():
        theirs = bridge.run_with_hooks(ids_a, return_type="logits", fwd_hooks=hooks)[:, -1:]
    ours = engine_patched_cache_logits(model, ids_a, ids_b, positions, [last], tail=1)
    assert (ours - theirs.float()).abs().max().item() <= ATOL


# --- the real default model -------------------------------------------------------------------------
PROMPT_A = "Alice has a red apple and Bob has a green pear. Alice's apple is"
PROMPT_B = "Alice has a blue apple and Bob has a green pear. Alice's apple is"


@pytest.fixture(scope="module")
def real_pair():
    from kvnotes.models import WeightsError, load_model

    try:
        model = load_model("llama", device="cpu", dtype="float32")
    except WeightsError as e:
        pytest.skip(f"real model not available: {e}")
    return model, boot_bridge(model, model.tokenizer)


def _real_ids(model: LoadedModel) -> tuple[Tensor, Tensor]:
    a = model.tokenizer(PROMPT_A, return_tensors="pt").input_ids
    b = model.tokenizer(PROMPT_B, return_tensors="pt").input_ids
    assert a.shape == b.shape, "the two prompts must tokenize to the same length"
    return a, b


@pytest.mark.real
def test_real_continuation_matches_bridge(real_pair):
    model, bridge = real_pair
    ids, _ = _real_ids(model)
    split = 6
    with torch.no_grad():
        theirs = bridge(ids, return_type="logits").float()[:, split:]
    first = prefill(model, ids[:, :split])
    ours = extend(model, first.cache, ids[:, split:], logits_to_keep=0).logits
    assert (ours - theirs).abs().max().item() <= ATOL


@pytest.mark.real
@pytest.mark.parametrize("positions,layers", [([3], list(range(0, 15))), ([3, 4], [2, 9, 20, 29])])
def test_real_kv_patch_matches_bridge_hooks(real_pair, positions, layers):
    model, bridge = real_pair
    ids_a, ids_b = _real_ids(model)
    ours = engine_patched_cache_logits(model, ids_a, ids_b, positions, layers, tail=1)
    theirs = bridge_patched_cache_logits(bridge, ids_a, ids_b, positions, layers, tail=1)
    assert (ours - theirs).abs().max().item() <= ATOL
    clean = extend(model, prefill(model, ids_a[:, :-1]).cache, ids_a[:, -1:]).logits
    assert (ours - clean).abs().max().item() > 1e-2, "the patch changed nothing: vacuous test"
