"""Generation from a kvnotes cache: transformers' `generate` continuing after a `KVCache`.

The cache is handed to `generate` as a `DynamicCache` over its tensors (a forward rebinds each
layer, never writes into ours), so the caller's cache is unchanged. transformers expands the
prompt's ids to `num_return_sequences` rows (or `num_beams`) but not a cache passed in, so the
batch-1 cache is expanded here to the same rows (a view). The result is a `GenerateOutput`:
the new token ids, their text, and the per-step scores when asked for, as Hugging Face users
expect from `generate(..., return_dict_in_generate=True)`.
"""

from __future__ import annotations

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


def _rows(model: LoadedModel, kwargs: dict[str, Any]) -> int:
    """How many rows transformers runs per prompt: num_beams for beam search, else
    num_return_sequences (from the kwargs, a `generation_config` given, or the model's own)."""
    cfg = kwargs.get("generation_config") or getattr(model.hf, "generation_config", None)
    beams = int(kwargs.get("num_beams") or getattr(cfg, "num_beams", 1) or 1)
    n = int(kwargs.get("num_return_sequences") or getattr(cfg, "num_return_sequences", 1) or 1)
    if n > 1 and beams == 1 and not kwargs.get("do_sample", getattr(cfg, "do_sample", False)):
        raise ConfigError(f"num_return_sequences={n} needs do_sample=True (n samples) or num_beams >= {n} "
                          f"(the n best beams); greedy decoding has one answer")
    return beams if beams > 1 else n


@torch.inference_mode()
def generate(model: LoadedModel, cache: KVCache, ids: Ids, max_new_tokens: int, **kwargs: Any) -> GenerateOutput:
    """transformers' `generate` continuing `ids` after `cache` (which holds all of `ids` but the
    last few: docs/conventions.md), `cache` unchanged; `kwargs` pass through (sampling,
    `num_return_sequences`, `num_beams`, `output_scores`, ...)."""
    x = as_ids(model, ids)
    check_cache(model, cache)
    if x.shape[0] != 1 or cache.batch != 1:
        raise ValueError(f"generate takes one prompt and a batch-1 cache, got {x.shape[0]} and {cache.batch}")
    past = cache.to(device=model.device)
    rows = _rows(model, kwargs)
    if rows > 1:
        past = past.expand(rows)  # [rows, kv_head, pos, d_head], a view: forwards never write into it
    out = model.hf.generate(  # type: ignore[operator]
        input_ids=x, attention_mask=torch.ones_like(x), past_key_values=past.to_dynamic(),
        max_new_tokens=max_new_tokens, **{**kwargs, "return_dict_in_generate": True},
    )
    scores = None if out.scores is None else torch.stack(out.scores, dim=1).float()
    logits = None if out.logits is None else torch.stack(out.logits, dim=1).float()
    return GenerateOutput(out.sequences, x.shape[1], scores, logits, model.tokenizer)
