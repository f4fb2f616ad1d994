"""Generation from a kvnotes cache: transformers' `generate` continuing after a `KVCache`.

The cache is handed to `generate` as a `DynamicCache` over its tensors (a forward rebinds each
layer, never writes into ours), so the caller's cache is unchanged. transformers expands the
prompt's ids to `num_return_sequences` rows (or `num_beams`) but not a cache passed in, so the
batch-1 cache is expanded here to the same rows (a view). The result is a `GenerateOutput`:
the new token ids, their text, and the per-step scores when asked for, as Hugging Face users
expect from `generate(..., return_dict_in_generate=True)`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, as_ids, check_cache
from kvnotes.errors import ConfigError
from kvnotes.models.loading import LoadedModel


@dataclass(frozen=True, repr=False, eq=False)
class GenerateOutput:
    """What `generate` made: `ids` the new tokens of each returned sequence ([n, new], the prompt
    left out; rows that stopped early are padded after their EOS), `sequences` prompt + new as
    transformers returns them, `text` / `texts` the new tokens decoded (special tokens skipped),
    and `scores` / `logits` ([n, new, vocab], fp32) when `output_scores=True` /
    `output_logits=True` were passed. `str(out)` is `out.text`, the first sequence's text."""

    sequences: Int[Tensor, "n total"]
    prompt_length: int
    scores: Float[Tensor, "n new vocab"] | None = None
    logits: Float[Tensor, "n new vocab"] | None = None
    tokenizer: Any = field(default=None, compare=False)

    @property
    def ids(self) -> Int[Tensor, "n new"]:
        return self.sequences[:, self.prompt_length :]

    @property
    def texts(self) -> list[str]:
        if self.tokenizer is None:
            raise ValueError("text needs a tokenizer: wrap_model(hf, tokenizer=...)")
        return [str(t) for t in self.tokenizer.batch_decode(self.ids, skip_special_tokens=True)]

    @property
    def text(self) -> str:
        return self.texts[0]

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        n, new = self.ids.shape
        shown = repr(self.text) if self.tokenizer is not None else f"ids={self.ids[0].tolist()}"
        return f"GenerateOutput({shown}, sequences={n}, new_tokens={new})"


DEFAULT_NEW_TOKENS = 16  # when neither max_new_tokens nor max_length is given


def _count(kwargs: dict[str, Any], key: str) -> int | None:
    """kwargs[key] as an int >= 1 (None when absent or None); ConfigError in one line otherwise."""
    value = kwargs.get(key)
    if value is None:
        return None
    try:
        n = operator.index(value)  # an int, numpy's included
    except TypeError:
        n = 0
    if isinstance(value, bool) or n < 1:
        raise ConfigError(f"{key} must be an int >= 1, got {value!r}")
    return n


def _rows(model: LoadedModel, kwargs: dict[str, Any]) -> int:
    """How many rows transformers runs per prompt: num_beams for beam search, else
    num_return_sequences (from the kwargs, a `generation_config` given, or the model's own)."""
    cfg = kwargs.get("generation_config") or getattr(model.hf, "generation_config", None)
    beams = _count(kwargs, "num_beams") or int(getattr(cfg, "num_beams", 1) or 1)
    n = _count(kwargs, "num_return_sequences") or int(getattr(cfg, "num_return_sequences", 1) or 1)
    if n > 1 and beams == 1 and not kwargs.get("do_sample", getattr(cfg, "do_sample", False)):
        raise ConfigError(f"num_return_sequences={n} needs do_sample=True (n samples) or num_beams >= {n} "
                          f"(the n best beams); greedy decoding has one answer")
    return beams if beams > 1 else n


def length_kwargs(model: LoadedModel, prompt: int, max_new_tokens: int | None,
                  kwargs: dict[str, Any]) -> dict[str, int]:
    """What `generate` passes transformers for the length, as Hugging Face reads it: max_new_tokens
    new tokens, or max_length tokens in all (prompt included), or a `generation_config`'s
    max_new_tokens; else DEFAULT_NEW_TOKENS. Refused in one line: both given, a max_length the
    prompt already fills, or more tokens than the model's `max_positions` (what load_model read
    from its config; a wrapped model's are not checked, as in `run.check_positions`)."""
    if max_new_tokens is not None and kwargs.get("max_length") is not None:
        raise ConfigError(f"give max_new_tokens (new tokens) or max_length (prompt + new tokens), not "
                          f"both: got {max_new_tokens} and {kwargs['max_length']}")
    length = _count(kwargs, "max_length")
    config_new = getattr(kwargs.get("generation_config"), "max_new_tokens", None)
    if length is not None:
        if length <= prompt:
            raise ConfigError(f"max_length={length} counts the prompt's {prompt} tokens too: use "
                              f"max_length > {prompt}, or max_new_tokens")
        new, what, out = length - prompt, f"max_length={length}", {"max_length": length}
    elif max_new_tokens is None and isinstance(config_new, int):
        new, what, out = config_new, f"generation_config.max_new_tokens={config_new}", {}
    else:
        new = _count({"max_new_tokens": max_new_tokens}, "max_new_tokens") or DEFAULT_NEW_TOKENS
        what, out = f"max_new_tokens={new}", {"max_new_tokens": new}
    limit = model.max_positions  # as run.check_positions: set by load_model, None for wrap_model
    if limit is not None and prompt + new > limit:
        raise ConfigError(f"{what} after the prompt's {prompt} tokens passes the {limit} positions of "
                          f"model {model.name!r} (max_position_embeddings); use max_new_tokens <= "
                          f"{max(limit - prompt, 0)}")
    return out


def _stop_strings(model: LoadedModel, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model's tokenizer for `stop_strings` (transformers needs one passed), unless given."""
    cfg = kwargs.get("generation_config") or getattr(model.hf, "generation_config", None)
    if not (kwargs.get("stop_strings") or getattr(cfg, "stop_strings", None)) or kwargs.get("tokenizer"):
        return {}
    if model.tokenizer is None:
        raise ConfigError("stop_strings needs a tokenizer: wrap_model(hf, tokenizer=...) or tokenizer=...")
    return {"tokenizer": model.tokenizer}


@torch.inference_mode()
def generate(model: LoadedModel, cache: KVCache, ids: Ids, max_new_tokens: int | None = None,
             **kwargs: Any) -> GenerateOutput:
    """transformers' `generate` continuing `ids` after `cache` (which holds all of `ids` but the
    last few: docs/conventions.md), `cache` unchanged; `kwargs` pass through (sampling,
    `num_return_sequences`, `num_beams`, `output_scores`, `stop_strings`, ...).

    The length is read as Hugging Face reads it (`length_kwargs`: `max_new_tokens`, else
    `max_length` counting the prompt, else 16 new tokens) and bounded by `model.max_positions`;
    `stop_strings` use the model's tokenizer. The result is always a `GenerateOutput` (its
    `.sequences` is what `return_dict_in_generate=False` would return: refused in one line)."""
    if kwargs.get("return_dict_in_generate") is False:
        raise ConfigError("return_dict_in_generate=False is not supported: generate returns a "
                          "GenerateOutput, whose .sequences is the tensor transformers would return")
    x = as_ids(model, ids)
    check_cache(model, cache)
    if x.shape[0] != 1 or cache.batch != 1:
        raise ValueError(f"generate takes one prompt and a batch-1 cache, got {x.shape[0]} and {cache.batch}")
    length = length_kwargs(model, x.shape[1], max_new_tokens, kwargs)
    rows = _rows(model, kwargs)
    stop = _stop_strings(model, kwargs)
    past = cache.to(device=model.device)
    if rows > 1:
        past = past.expand(rows)  # [rows, kv_head, pos, d_head], a view: forwards never write into it
    rest = {k: v for k, v in kwargs.items() if k not in ("max_length", "max_new_tokens")}
    out = model.hf.generate(  # type: ignore[operator]
        input_ids=x, attention_mask=torch.ones_like(x), past_key_values=past.to_dynamic(),
        **{**rest, **length, **stop, "return_dict_in_generate": True},
    )
    scores = None if out.scores is None else torch.stack(out.scores, dim=1).float()
    logits = None if out.logits is None else torch.stack(out.logits, dim=1).float()
    return GenerateOutput(out.sequences, x.shape[1], scores, logits, model.tokenizer)
