"""Tiny random models of every supported family, for exactness tests in seconds.

Each family's adapter builds its tiny config (`FamilyAdapter.tiny_config`, sizes `TINY_COMMON`),
which exercises the family's quirk: llama3 rope scaling (llama), YaRN attention_scaling (qwen3),
q/k/v biases (qwen2), a sliding window shorter than the test sequences (mistral, gemma2, gemma3)
and gemma3's per-layer-type rope bases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvnotes.models.adapters import FAMILIES, adapter_for
from kvnotes.models.devices import resolve_device, resolve_dtype
from kvnotes.models.loading import LoadedModel, freeze, weights_id, wrap_model
from kvnotes.models.wheels import WeightsError


def tiny_config(family: str) -> Any:
    """The tiny random config of `family`, from its adapter (`FamilyAdapter.tiny_config`)."""
    if family not in FAMILIES:
        raise KeyError(f"no tiny config for {family!r}; families: {', '.join(FAMILIES)}")
    return adapter_for(family).tiny_config()


def tiny_tokenizer() -> Any:
    """A character-level tokenizer in memory (< 256 ids, fits every tiny model).

    A space and the character after it form one token, so words keep distinct first tokens
    (" grant" -> " g"), as the decision readout of task items needs.
    """
    # deferred: tokenizers is heavy and only this path needs it
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    # deferred: transformers is heavy and only this path needs it
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "\n", *(chr(c) for c in range(32, 127))]
    vocab = chars + [" " + c for c in chars[3:]]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens are pieces of text: join them as they are
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A randomly initialised model of `family` (4 layers, d=64) with `tiny_tokenizer()`."""
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg._attn_implementation = adapter_for(family).attn_implementation
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    freeze(hf)  # as load_model: inference only, nnsight outputs without requires_grad
    return wrap_model(hf, tiny_tokenizer(), name=f"tiny-{family}")


def random_model(folder: str, device: str = "auto", dtype: str = "auto", seed: int = 0) -> LoadedModel:
    """A model of a checkpoint folder's architecture with random weights, for timing and memory.

    The folder holds a config.json and tokenizer files, no weights (`benchmarks.shapes` writes
    one for a hub model these machines cannot fetch, e.g. Llama-3.1-8B). The weights are
    initialised on the device, so an 8B model costs seconds, not a 16 GB download. What it
    computes is noise: its speed and memory are those of the real model, its logits are not.
    The weights' fingerprint (`kvnotes.models.loading.weights_id`) is taken once here, as a loaded model's
    checksum is: stored blocks are matched to it without re-reading the parameters per load.
    `device="meta"` allocates nothing: the sizes alone, for `kvnotes.measure.timing.check_fits(...,
    device=...)` before the weights exist.
    """

    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise WeightsError(f"no config.json in {folder}: random_model needs a folder with a config and a tokenizer")
    cfg = AutoConfig.from_pretrained(str(path))
    family = adapter_for(cfg.get_text_config(decoder=True).model_type).family
    cfg._attn_implementation = adapter_for(family).attn_implementation
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, None, dev)
    torch.manual_seed(seed)
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    freeze(hf)
    model = wrap_model(hf, AutoTokenizer.from_pretrained(str(path)), name=f"random:{path.name}")
    if dev.type != "meta":  # on meta (sizes only, for a memory check) there are no values to hash
        model.checksum = weights_id(model)
    return model
