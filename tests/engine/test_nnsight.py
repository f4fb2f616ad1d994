"""`LoadedModel.nnsight` against plain torch forward hooks on the same modules.

nnsight wraps the very modules kvnotes runs, so a read or a patch through a trace must give the
same numbers as a forward hook doing the same thing by hand: reading a layer's output, and
patching the residual stream or the attention output at one position from a source prompt into
a destination prompt. The helpers in `kvnotes.engine.interp` are checked the same way. Module paths come
from the family adapter, so the tiny tests run over every family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from jaxtyping import Int
from tolerances import ATOL_FP32
from torch import Tensor, nn

from kvnotes.engine.interp import patch_head_outputs, residual_stream
from kvnotes.engine.run import full_logits, prefill
from kvnotes.models import FAMILIES, LoadedModel, wrap_model
from kvnotes.models.tiny import tiny_model

ATOL = 1e-5  # the same kernels run either way; only grad mode differs


# --- helpers -------------------------------------------------------------------------------------
def tiny_tokenizer(vocab_size: int = 128):
    """A word-level tokenizer `t0 .. t{n-1}` built in memory (nnsight's pipeline wants one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", unk_token="t0", pad_token="t3")


def random_ids(n: int, seed: int, vocab: int = 128) -> Int[Tensor, "1 pos"]:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _first(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output: Any, new: Tensor) -> Any:
    return (new, *output[1:]) if isinstance(output, tuple) else new


@contextmanager
def hooked(module: nn.Module, fn: Callable[..., Any], pre: bool = False) -> Iterator[None]:
    handle = module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def manual_output(model: LoadedModel, module: nn.Module, ids: Tensor) -> Tensor:
    store: dict[str, Tensor] = {}
    with hooked(module, lambda m, args, out: store.__setitem__("x", _first(out).clone())):
        model.hf(input_ids=ids, use_cache=False)
    return store["x"]


@torch.no_grad()
def manual_patch(model: LoadedModel, module: nn.Module, dst: Tensor, src: Tensor, pos: int) -> Tensor:
    """Logits of dst with `module`'s (first) output at `pos` taken from the src run."""
    donor = manual_output(model, module, src)

    def put(m: nn.Module, args: Any, out: Any) -> Any:
        new = _first(out).clone()
        new[:, pos] = donor[:, pos]
        return _replace_first(out, new)

    with hooked(module, put):
        return model.hf(input_ids=dst, use_cache=False).logits.float()


@torch.no_grad()
def manual_head_patch(
    model: LoadedModel, dst: Tensor, src: Tensor, heads: list[tuple[int, int]], pos: int
) -> Tensor:
    """Reference for `patch_head_outputs`: pre-hooks on o_proj, by hand. Returns [vocab]."""
    d = model.adapter.head_dim(model.hf)
    layers = sorted({layer for layer, _ in heads})
    donor: dict[int, Tensor] = {}
    handles = [
        model.adapter.o_proj(model.hf, layer).register_forward_pre_hook(
            lambda m, args, layer=layer: donor.__setitem__(layer, args[0][0, pos].clone())
        )
        for layer in layers
    ]
    model.hf(input_ids=src, use_cache=False)
    for h in handles:
        h.remove()

    def put(layer: int):
        def fn(m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            z = args[0].clone()  # [1, pos, n_heads * d_head]
            for lh, head in heads:
                if lh == layer:
                    z[0, pos, head * d : (head + 1) * d] = donor[layer][head * d : (head + 1) * d]
            return (z, *args[1:])

        return fn

    handles = [model.adapter.o_proj(model.hf, layer).register_forward_pre_hook(put(layer)) for layer in layers]
    try:
        return model.hf(input_ids=dst, use_cache=False).logits[0, pos].float()
    finally:
        for h in handles:
            h.remove()


def nnsight_patch(model: LoadedModel, module: nn.Module, dst: Tensor, src: Tensor, pos: int) -> Tensor:
    """The same patch with nnsight: one trace reads the source, a second one writes it."""
    envoy = model.nnsight.get(_module_path(model, module))
    with torch.no_grad():
        with model.nnsight.trace(src):
            donor = envoy.output.save()
        with model.nnsight.trace(dst):
            _first(envoy.output)[:, pos] = _first(donor)[:, pos]
            logits = model.nnsight.output.logits.save()
    return logits.float()


def _module_path(model: LoadedModel, module: nn.Module) -> str:
    return next(name for name, m in model.hf.named_modules() if m is module)


# --- tiny random models ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request) -> LoadedModel:
    return wrap_model(tiny_model(request.param).hf, tiny_tokenizer(), name=f"tiny-{request.param}")


def test_wrapper_shares_modules_and_leaves_the_engine_alone(tiny):
    ids = random_ids(30, seed=0)
    before = prefill(tiny, ids).logits
    lm = tiny.nnsight
    assert lm is tiny.nnsight, "built once"
    assert lm._module is tiny.hf, "nnsight must wrap the same module objects, not a copy"
    assert torch.equal(prefill(tiny, ids).logits, before)


def test_read_layer_outputs(tiny):
    ids = random_ids(30, seed=1)
    layers = tiny.adapter.layers(tiny.hf)
    envoys = [tiny.nnsight.get(_module_path(tiny, layer)) for layer in layers]
    saved: list[Tensor] = []  # only saved values leave a trace: a list made inside is dropped
    with torch.no_grad():
        with tiny.nnsight.trace(ids):
            for e in envoys:  # in execution order
                saved.append(_first(e.output).save())
            logits = tiny.nnsight.output.logits.save()
    for layer, got in zip(layers, saved, strict=True):
        assert (got - manual_output(tiny, layer, ids)).abs().max().item() <= ATOL
    assert (logits.float() - full_logits(tiny, ids)).abs().max().item() <= ATOL


@pytest.mark.parametrize("site", ["resid", "attn"])
@pytest.mark.parametrize("layer,pos", [(0, 5), (2, 17)])
def test_patch_matches_forward_hooks(tiny, site, layer, pos):
    dst, src = random_ids(30, seed=2), random_ids(30, seed=3)
    module = tiny.adapter.layers(tiny.hf)[layer] if site == "resid" else tiny.adapter.attention(tiny.hf, layer)
    ours = nnsight_patch(tiny, module, dst, src, pos)
    ref = manual_patch(tiny, module, dst, src, pos)
    assert (ours - ref).abs().max().item() <= ATOL
    clean = full_logits(tiny, dst)
    assert (ours[:, :pos] - clean[:, :pos]).abs().max().item() <= ATOL, "earlier positions moved"
    assert (ours[:, pos] - clean[:, pos]).abs().max().item() > 1e-3, "the patch changed nothing"


def test_patch_across_invokes_in_one_trace(tiny):
    """The batched form: two invokes in one trace, handed over at a barrier."""
    dst, src = random_ids(30, seed=4), random_ids(30, seed=5)
    layer, pos = 1, 12
    module = tiny.adapter.layers(tiny.hf)[layer]
    envoy = tiny.nnsight.get(_module_path(tiny, module))
    with torch.no_grad():
        with tiny.nnsight.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke(src):
                donor = _first(envoy.output)[:, pos]
                barrier()
            with tracer.invoke(dst):
                barrier()
                _first(envoy.output)[:, pos] = donor
                logits = tiny.nnsight.output.logits.save()
    assert (logits.float() - manual_patch(tiny, module, dst, src, pos)).abs().max().item() <= ATOL


# --- tracing on an edited cache ----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_trace_on_an_edited_cache_matches_exactly(family):
    """The documented recipe: an edit's cache, as a DynamicCache, is the `past_key_values` of an
    nnsight trace over the prompt's last token. Logits and layer outputs equal the HF forward on
    that cache bit for bit, and kvnotes' own `next_token_logits` within fp32 rounding (kvnotes
    may run another attention kernel)."""
    from kvnotes import EditableCache
    from kvnotes.edit.editable import demo_prompt

    model = tiny_model(family)  # with the character tokenizer EditableCache needs
    edit = EditableCache(model, demo_prompt()).edit("account_role: admin", "account_role: guest",
                                                    strategy="full_downstream")
    last = torch.tensor([edit.ids[-1:]])  # [1, 1]
    layer = model.adapter.layers(model.hf)[2]
    envoy = model.nnsight.get(_module_path(model, layer))
    with torch.no_grad():
        with model.nnsight.trace(last, past_key_values=edit.cache.to_dynamic()):
            hidden = _first(envoy.output).save()
            logits = model.nnsight.output.logits.save()
    ref: dict[str, Tensor] = {}
    with torch.no_grad(), hooked(layer, lambda m, args, out: ref.__setitem__("x", _first(out).clone())):
        hf_logits = model.hf(input_ids=last, past_key_values=edit.cache.to_dynamic()).logits
    assert torch.equal(hidden, ref["x"]) and torch.equal(logits, hf_logits)
    assert (logits[0, -1] - edit.next_token_logits()).abs().max().item() <= ATOL_FP32


# --- kvnotes.engine.interp ---------------------------------------------------------------------------------
def test_residual_stream_matches_hooks(tiny):
    ids = random_ids(20, seed=6)
    resid = residual_stream(tiny, ids)
    cfg = tiny.config
    assert resid.shape == (cfg.num_hidden_layers, 20, cfg.hidden_size)
    for i, layer in enumerate(tiny.adapter.layers(tiny.hf)):
        assert (resid[i] - manual_output(tiny, layer, ids)[0]).abs().max().item() <= ATOL
    with torch.no_grad():  # HF's hidden_states: embeddings, then each layer (the last one normed)
        hs = tiny.hf(input_ids=ids, output_hidden_states=True).hidden_states
    assert (resid[:-1] - torch.cat(hs[1:-1])).abs().max().item() <= ATOL


@pytest.mark.parametrize(
    "heads,pos",
    [([(3, 0), (0, 1), (3, 3)], -1), ([(2, 1), (2, 3)], 7)],
)
def test_patch_head_outputs_matches_hooks(tiny, heads, pos):
    dst, src = random_ids(25, seed=7), random_ids(25, seed=8)
    ours = patch_head_outputs(tiny, dst, src, heads, pos)
    ref = manual_head_patch(tiny, dst, src, heads, pos)
    assert ours.shape == (tiny.config.vocab_size,)
    assert (ours - ref).abs().max().item() <= ATOL
    assert (ours - full_logits(tiny, dst)[0, pos]).abs().max().item() > 1e-4, "the patch changed nothing"


def test_patch_head_outputs_edge_cases(tiny):
    dst, src = random_ids(25, seed=9), random_ids(18, seed=10)  # lengths may differ: pos=-1 each
    clean = full_logits(tiny, dst)[0, -1]
    assert (patch_head_outputs(tiny, dst, src, [], -1) - clean).abs().max().item() <= ATOL
    n_heads = tiny.adapter.n_heads(tiny.hf)
    every = [(layer, h) for layer in range(tiny.n_layers) for h in range(n_heads)]
    got = patch_head_outputs(tiny, dst, src, every, -1)
    assert (got - manual_head_patch(tiny, dst, src, every, -1)).abs().max().item() <= ATOL
    with pytest.raises(IndexError):
        patch_head_outputs(tiny, dst, src, [(tiny.n_layers, 0)], -1)
    with pytest.raises(IndexError):
        patch_head_outputs(tiny, dst, src, [(0, 0)], 25)


def test_nnsight_without_tokenizer_is_a_clear_error():
    """tiny_model() / wrap_model(hf) give tokenizer=None; nnsight's pipeline cannot guess one."""
    with pytest.raises(ValueError, match="nnsight needs a tokenizer"):
        _ = wrap_model(tiny_model("llama").hf).nnsight


def test_nnsight_leaves_the_tokenizer_alone():
    """Building the wrapper should not change padding of the tokenizer kvnotes shares with it."""
    tok = tiny_tokenizer()
    model = wrap_model(tiny_model("llama").hf, tok, name="tiny-llama")
    side = tok.padding_side
    pad = tok.pad_token
    _ = model.nnsight
    assert (tok.padding_side, tok.pad_token) == (side, pad)


# --- the real default model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real() -> LoadedModel:
    from kvnotes.models import WeightsError, load_model

    try:
        return load_model("llama", device="cpu", dtype="float32")
    except WeightsError as e:
        pytest.skip(f"real model not available: {e}")


@pytest.mark.real
def test_real_nnsight_patches_match_hooks(real):
    tok = real.tokenizer
    dst = tok("Alice has a red apple and Bob has a green pear. Alice's apple is", return_tensors="pt").input_ids
    src = tok("Alice has a blue apple and Bob has a green pear. Alice's apple is", return_tensors="pt").input_ids
    assert dst.shape == src.shape
    pos, layer = 3, 10  # the colour word
    for module in (real.adapter.layers(real.hf)[layer], real.adapter.attention(real.hf, layer)):
        ours = nnsight_patch(real, module, dst, src, pos)
        ref = manual_patch(real, module, dst, src, pos)
        assert (ours - ref).abs().max().item() <= 1e-4
    resid = residual_stream(real, dst)
    assert (resid[layer] - manual_output(real, real.adapter.layers(real.hf)[layer], dst)[0]).abs().max() <= 1e-4
    heads = [(layer, 0), (layer, 5), (20, 3)]
    got = patch_head_outputs(real, dst, src, heads, -1)
    assert (got - manual_head_patch(real, dst, src, heads, -1)).abs().max().item() <= 1e-4


# --- what a user's own trace hands back (issue #34) ---------------------------------------------------
def _trace_edited(model: LoadedModel, strategy: str) -> tuple[Tensor, Tensor, Any]:
    """The documented recipe, as a user writes it (no torch.no_grad): nnsight's and model.hf's
    logits of the last prompt token on an edited cache, and the edit."""
    from kvnotes import EditableCache
    from kvnotes.edit.editable import demo_prompt

    edit = EditableCache(model, demo_prompt()).edit("account_role: admin", "account_role: guest",
                                                    strategy=strategy)
    last = torch.tensor([edit.ids[-1:]])  # [1, 1]: the cache holds every token but the last
    with model.nnsight.trace(last, past_key_values=edit.cache.to_dynamic()):
        logits = model.nnsight.output.logits.save()
    hf_logits = model.hf(input_ids=last, past_key_values=edit.cache.to_dynamic()).logits
    return logits, hf_logits, edit


def test_a_users_trace_carries_no_grad():
    logits, hf_logits, _ = _trace_edited(tiny_model("qwen2"), "erratum")
    assert not logits.requires_grad and not hf_logits.requires_grad
    assert torch.equal(logits, hf_logits)


@pytest.mark.real
def test_real_trace_on_an_edit_equals_hf_and_the_engine_within_rounding(real):
    """nnsight = model.hf bit for bit; = kvnotes' next_token_logits within fp32 rounding (the engine
    attends through kvnotes.engine.causal, another summation order): the bound the docs state."""
    worst = 0.0
    for strategy in ("erratum", "full_downstream", "selective"):
        logits, hf_logits, edit = _trace_edited(real, strategy)
        assert not logits.requires_grad and torch.equal(logits, hf_logits)
        worst = max(worst, (logits[0, -1].float() - edit.next_token_logits()).abs().max().item())
    print(f"nnsight vs next_token_logits on llama fp32: max |diff| = {worst:.2e}")
    assert worst <= 5e-5
