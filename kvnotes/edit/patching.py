"""Activation patching on the KV cache of a task item: stale, oracle and everything between.

For an item with token-aligned old and new prompts, the *stale* cache is a prefill of the old
prompt (without its last token), the *oracle* a prefill of the new one. A patched state takes
the oracle's K/V at chosen positions and layers and the stale K/V elsewhere; the last prompt
token then runs against it and the decision score is read. recovery = (score - stale) /
(oracle - stale): 0 behaves like the old prompt, 1 like the new. Many states of one item are read
in one batched call (kvnotes.engine.variants.read_variants), never by materialising patched caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine.cache import KVCache, cat
from kvnotes.engine.run import extend, prefill
from kvnotes.engine.variants import read_variants
from kvnotes.measure.metrics import recovery
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem


@dataclass(frozen=True)
class PatchPair:
    """The stale and oracle caches of one item (positions 0..n-2) and its decision readout."""

    item: TaskItem
    old: KVCache
    new: KVCache
    tail: Int[Tensor, "1 tail"]  # the last prompt token, identical in old and new
    score_stale: float
    score_oracle: float

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


def scores_from_logits(item: TaskItem, logits: Float[Tensor, "n vocab"]) -> np.ndarray:
    return item.decision_score(logits).cpu().numpy().astype(np.float64)


def make_pair(model: LoadedModel, item: TaskItem) -> PatchPair:
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
    tail = torch.tensor([item.old_ids[-1:]])
    logits = read_variants(model, old, new, [[], list(range(old.seq_len))], tail)[:, -1]
    stale, oracle = scores_from_logits(item, logits)
    return PatchPair(item, old, new, tail, float(stale), float(oracle))


def patched_scores(
    model: LoadedModel,
    pair: PatchPair,
    positions: Sequence[Sequence[int]],
    layers: Sequence[Sequence[int] | None] | None = None,
    key_mask: Tensor | None = None,
    batch_size: int | None = None,
) -> np.ndarray:
    """Decision score of each patched state (positions[i] at layers[i] from the oracle).

    `batch_size` states are read at once; None sizes the batches from the free memory.
    """
    logits = read_variants(
        model, pair.old, pair.new, positions, pair.tail, layers, key_mask, batch_size,
        vocab=list(pair.item.score_ids),
    )[:, -1]  # [n, 2]: the two decision tokens only
    return (logits[:, 0] - logits[:, 1]).cpu().numpy().astype(np.float64)


def recoveries(pair: PatchPair, scores: np.ndarray, min_denominator: float = 1e-4) -> np.ndarray:
    out = recovery(scores, pair.score_stale, pair.score_oracle, min_denominator)
    return np.atleast_1d(np.asarray(out, dtype=np.float64))
