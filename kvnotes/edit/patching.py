"""Activation patching on the KV cache of a prompt pair: stale, oracle and everything between.

For a task item or a user's `kvnotes.Pair` with token-aligned old and new prompts, the *stale* cache is a prefill of the old
prompt (without its last token), the *oracle* a prefill of the new one. A patched state takes
the oracle's K/V at chosen positions and layers and the stale K/V elsewhere; the last prompt
token then runs against it and the pair's metric is read (kvnotes.measure.score). recovery = (score - stale) /
(oracle - stale): 0 behaves like the old prompt, 1 like the new. Many states of one item are read
in one batched call (kvnotes.engine.variants.read_variants), never by materialising patched caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine import interp
from kvnotes.engine.cache import KVCache, cat
from kvnotes.engine.run import extend, prefill
from kvnotes.engine.variants import read_variants
from kvnotes.measure.metrics import recovery
from kvnotes.measure.score import Metric
from kvnotes.models.loading import LoadedModel


@dataclass(frozen=True)
class PatchPair:
    """The stale and oracle caches of one pair (positions 0..n-2) and its metric's readout.

    `item` is a task suite's `TaskItem` or a user's `kvnotes.Pair`: both carry old_ids, new_ids,
    field_span, item_id and a metric. `metric` is the item's, bound to the oracle's logits when
    it needs a reference (KL to the clean distribution)."""

    item: Any
    old: KVCache
    new: KVCache
    tail: Int[Tensor, "1 tail"]  # the last prompt token, identical in old and new
    score_stale: float
    score_oracle: float
    metric: Metric

    @property
    def n_cached(self) -> int:
        return self.old.seq_len

    @property
    def delta(self) -> float:
        return self.score_oracle - self.score_stale

    @property
    def field_positions(self) -> list[int]:
        return list(range(*self.item.field_span))

    @property
    def downstream_positions(self) -> list[int]:
        """Cached positions after the field: where the notes can be."""
        return list(range(self.item.field_span[1], self.n_cached))

    @property
    def field_to_end(self) -> list[int]:
        return list(range(self.item.field_span[0], self.n_cached))


def scores_from_logits(metric: Metric, logits: Float[Tensor, "n vocab"]) -> np.ndarray:
    """A next-token metric (`PatchPair.metric`) of each row of logits, as float64."""
    return metric(logits).cpu().numpy().astype(np.float64)


def metric_scores(
    model: LoadedModel,
    old: KVCache,
    new: KVCache,
    metric: Metric,
    last: int,
    positions: Sequence[Sequence[int]],
    layers: Sequence[Sequence[int] | None] | None = None,
    key_mask: Tensor | None = None,
    batch_size: int | None = None,
    mask_layers: Tensor | None = None,
    mask_heads: Tensor | None = None,
    full_vocab: bool = False,
) -> np.ndarray:
    """The metric of each variant of `old` (positions[i] at layers[i] from `new`; keys hidden by
    `key_mask`), summed over its terms: each term runs the last prompt token and its teacher-forced
    continuation once per variant, reading only its vocabulary rows unless `full_vocab`."""
    def run(tail: list[int], vocab: tuple[int, ...] | None) -> Tensor:
        logits = read_variants(model, old, new, positions, torch.tensor([tail]), layers, key_mask, batch_size,
                               mask_layers=mask_layers, mask_heads=mask_heads,
                               vocab=None if full_vocab or vocab is None else list(vocab))  # [n, tail, k]
        return logits[..., list(vocab)] if full_vocab and vocab is not None else logits
    return metric.read(run, last).cpu().numpy().astype(np.float64)


def make_pair(model: LoadedModel, item: Any) -> PatchPair:
    """Prefill old and new (the shared prefix once) and read the stale and oracle scores."""
    if item.field_span[1] >= item.n_tokens:
        raise ValueError(f"{item.item_id}: the field must end before the decision token")
    start = item.field_span[0]
    shared = prefill(model, item.old_ids[:start]).cache if start > 0 else None
    rest = torch.tensor([item.old_ids[start:-1], item.new_ids[start:-1]])  # [2, n-1-start]
    both = extend(model, shared, rest).cache  # batch 2: old, new
    old, new = both.batch_item(0), both.batch_item(1)
    if shared is not None:  # the batch-2 cache holds the shared prefix expanded; keep one copy
        old = cat([shared, old.slice(start)])
        new = cat([shared, new.slice(start)])
    last = int(item.old_ids[-1])
    metric: Metric = item.metric
    if metric.needs_reference:  # KL to the clean run: its next-token logits are the reference
        ref = read_variants(model, old, new, [list(range(old.seq_len))], torch.tensor([[last]]))[0, -1]
        metric = metric.bind(ref)
    stale, oracle = metric_scores(model, old, new, metric, last, [[], list(range(old.seq_len))],
                                  full_vocab=True)
    return PatchPair(item, old, new, torch.tensor([[last]]), float(stale), float(oracle), metric)


def patched_scores(
    model: LoadedModel,
    pair: PatchPair,
    positions: Sequence[Sequence[int]],
    layers: Sequence[Sequence[int] | None] | None = None,
    key_mask: Tensor | None = None,
    batch_size: int | None = None,
    mask_layers: Tensor | None = None,
    mask_heads: Tensor | None = None,
) -> np.ndarray:
    """The metric of each patched state (positions[i] at layers[i] from the oracle; keys hidden by
    `key_mask` at `mask_layers` / `mask_heads`). `batch_size` states are read at once; None sizes
    the batches from the free memory."""
    return metric_scores(model, pair.old, pair.new, pair.metric, int(pair.tail[0, -1]), positions, layers,
                         key_mask, batch_size, mask_layers, mask_heads)


def recoveries(pair: PatchPair, scores: np.ndarray, min_denominator: float = 1e-4) -> np.ndarray:
    out = recovery(scores, pair.score_stale, pair.score_oracle, min_denominator)
    return np.atleast_1d(np.asarray(out, dtype=np.float64))


def head_scores(model: LoadedModel, pair: PatchPair, z_new: torch.Tensor, masks: torch.Tensor,
                batch_size: int) -> np.ndarray:
    """The pair's metric when, in variant i, the heads `masks[i]` ([n, layer, head]) output at the
    decision token what they output in the new run (a teacher-forced continuation runs after it)."""
    def run(tail: list[int], vocab: tuple[int, ...] | None) -> torch.Tensor:
        logits = interp.patch_heads_at_tail(model, pair.old, torch.tensor([tail]), z_new, masks, batch_size,
                                            at=0, all_rows=True)  # [n, tail, vocab]
        return logits if vocab is None else logits[..., list(vocab)]
    return pair.metric.read(run, int(pair.tail[0, -1])).cpu().numpy().astype(np.float64)
