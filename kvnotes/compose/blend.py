"""Cache blending: which tokens of reused blocks to recompute, at one budget for every rule.

A prompt is a head (cached exactly), blocks each prefilled alone and RoPE-moved to where they
land (`compose.transplant`, seam 0: naive reuse), then a tail run on top. The blocks never saw
what precedes them; a selection rule picks block positions whose K/V are recomputed against the
reused neighbours (`run.recompute`: each chosen token sees the stale K/V around it and the
other chosen tokens causally). Budgets are fractions r of the block tokens:

* seam K (EPIC's LegoLink): the first K tokens of every block, `compose.transplant(seam=K)`;
* CacheBlend r: the round(r * N) block tokens with the largest key deviation at an early check
  layer l, dev(p) = || K_fresh[l, p] - K_reused[l, p] ||_2 over heads and dims, K_fresh from a
  prefill of the context through layer l only (`partial.early_keys`; LMCache's blender also compares
  keys, at layer 1). One set is recomputed at every layer: CacheBlend's gradual narrowing of the
  set in later layers is not reproduced, so this is its first selection step at full depth;
* note-aware r: round(r * L_j) tokens of each block j taken from its aggregator tokens
  (newlines first, then punctuation and section marks, each class spread evenly over the block),
  the positions the paper finds holding the memoized conclusions. No check pass; a block with
  fewer aggregators than its budget recomputes fewer tokens (the record says how many). With
  `seam` S > 0 each block's budget first buys its first S tokens (its stale attention sink and
  section header), then aggregators: recomputed notes that still see every block's own sink are
  worse than none on llama (skills cosine 0.79 at 15 % vs 0.82 naive), with the sinks repaired
  they beat seam repair alone on some items (0.928 vs 0.904).

* attribution r: the budget(N, r) block tokens whose stale K/V move the question's answer most,
  to first order: a(p) = |dK_c[p] . dS/dK_c[p] + dV_c[p] . dS/dV_c[p]|, with dS/d(K, V) the
  gradient at the naive splice (one forward and backward of the tail, kvnotes.engine.gradients)
  of S = log p(the naive splice's own top answer token) at the last tail position, and dK_c, dV_c
  the deviation CacheBlend's cheap recompute measures at its check layer c (fresh minus reused,
  `partial.early_kv`). Only layer c is used: deeper deviations would need the full prefill the
  method avoids, and a token's later-layer deviations grow from its early one. The log-prob of
  the answer the splice gives, not a gold answer, because a real system has none;
* query-aware r (ProphetKV's rule): the budget(N, r) block tokens the question attends to most
  at the naive splice: the tail's attention weights summed over every layer, query head and
  tail token (one tail forward, `variants.read_variants` capturing the weights). No check pass.

APE (arXiv 2502.05431) is training-free, but it is not run here: it encodes blocks in parallel
at shared positions and rescales, for every later query, the attention to block keys (a
temperature T and a factor S inside the softmax). Temperature alone is a key scaling; S needs an
additive per-key bias in every layer that `run.extend` does not expose, and T, S are tuned per
task on held-out data; an untuned pair would be a strawman.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.compose import splice as compose
from kvnotes.engine import partial, run
from kvnotes.engine.cache import KVCache
from kvnotes.engine.gradients import cache_gradients
from kvnotes.engine.variants import read_variants
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.tokens import is_aggregator

FAMILIES = ("naive", "seam", "cacheblend", "notes", "attribution", "query_aware")  # rules on top of reused blocks
RANKED = ("cacheblend", "attribution", "query_aware")  # the top budget(N, r) block tokens by a score


@dataclass(frozen=True)
class Layout:
    """Token ids of a prompt cut into head, blocks (in prompt order) and tail."""

    head: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.blocks or any(len(b) == 0 for b in self.blocks):
            raise ValueError("a layout needs at least one block and no empty block")
        if not self.tail:
            raise ValueError("a layout needs a tail (the tokens run on top of the context)")

    @property
    def context(self) -> list[int]:
        return [*self.head, *(t for b in self.blocks for t in b)]

    @property
    def ids(self) -> list[int]:
        return self.context + list(self.tail)

    @property
    def starts(self) -> list[int]:
        """Absolute position of each block's first token."""
        out, pos = [], len(self.head)
        for b in self.blocks:
            out.append(pos)
            pos += len(b)
        return out

    @property
    def n_block_tokens(self) -> int:
        return sum(len(b) for b in self.blocks)

    def block_positions(self) -> list[int]:
        return [s + i for s, b in zip(self.starts, self.blocks) for i in range(len(b))]


def budget(n: int, fraction: float) -> int:
    """round(fraction * n), at least 1 when fraction > 0, at most n."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"a budget is a fraction in [0, 1], got {fraction}")
    k = math.floor(fraction * n + 0.5)
    return min(n, max(k, 1 if fraction > 0 else 0))


def spread(items: Sequence[int], k: int) -> list[int]:
    """k of `items` evenly spaced over the list (all of them when k >= len)."""
    m = len(items)
    if k >= m:
        return list(items)
    return [items[math.floor((i + 0.5) * m / k)] for i in range(k)]


# --- selection rules ---------------------------------------------------------------------------


def seam_positions(layout: Layout, k: int) -> list[int]:
    """The first min(k, L_j) positions of every block (what `transplant(seam=k)` recomputes)."""
    if k < 0:
        raise ValueError(f"seam K must be >= 0, got {k}")
    return [s + i for s, b in zip(layout.starts, layout.blocks) for i in range(min(k, len(b)))]


def key_deviation(
    model: LoadedModel, reused: KVCache, context: Sequence[int], layer: int
) -> Float[Tensor, " pos"]:
    """|| K_fresh - K_reused ||_2 per position at `layer` (fp32), K_fresh from a clean prefill."""
    if not 0 <= layer < model.n_layers:
        raise ValueError(f"check layer must be in 0..{model.n_layers - 1}, got {layer}")
    if reused.seq_len != len(context):
        raise ValueError(f"reused cache has {reused.seq_len} positions, context {len(context)}")
    fresh = partial.early_keys(model, list(context), layer).float()  # [1, kv_head, pos, d_head]
    old = reused.keys[layer].to(fresh.device).float()  # [1, kv_head, pos, d_head]
    return (fresh - old).pow(2).sum(dim=(0, 1, 3)).sqrt().cpu()  # [pos]


def cacheblend_positions(
    deviation: Float[Tensor, " pos"], layout: Layout, fraction: float
) -> list[int]:
    """The budget(N, fraction) block positions with the largest score (CacheBlend: key deviation;
    also the attribution and query-aware scores), sorted."""
    cand = torch.tensor(layout.block_positions())
    k = budget(len(cand), fraction)
    if k == 0:
        return []
    top = deviation[cand].topk(k).indices  # ties: lowest index first (stable enough, seeded)
    return sorted(int(p) for p in cand[top])


def answer_attribution(
    model: LoadedModel, reused: KVCache, layout: Layout, layer: int
) -> Float[Tensor, " pos"]:
    """|dK . dS/dK + dV . dS/dV| per context position at `layer` (fp32): the gradient of the naive
    splice's answer log-prob times the fresh-minus-reused K/V of a prefill through `layer` only."""
    if not 0 <= layer < model.n_layers:
        raise ValueError(f"check layer must be in 0..{model.n_layers - 1}, got {layer}")

    def answer_logprob(logits: Tensor) -> Tensor:  # [tail, vocab] -> log p(its own top token)
        last = torch.log_softmax(logits[-1], dim=-1)
        return last[int(last.argmax())]

    grads = cache_gradients(model, reused, list(layout.tail), answer_logprob)
    fresh_k, fresh_v = partial.early_kv(model, layout.context, layer)  # [1, kv_head, pos, d_head]
    dev = grads.grad_keys[layer].device
    dk = fresh_k[0].to(dev).float() - reused.keys[layer][0].to(dev).float()  # [kv_head, pos, d_head]
    dv = fresh_v[0].to(dev).float() - reused.values[layer][0].to(dev).float()
    eff = (dk * grads.grad_keys[layer]).sum(dim=(0, 2)) + (dv * grads.grad_values[layer]).sum(dim=(0, 2))
    return eff.abs().cpu()  # [pos]


def query_attention(model: LoadedModel, reused: KVCache, layout: Layout) -> Float[Tensor, " pos"]:
    """The question's attention to each cached position at the naive splice, summed over layers,
    query heads and tail tokens (fp32)."""
    capture: list[dict[int, Tensor]] = []
    read_variants(model, reused, reused, [[]], list(layout.tail), batch_size=1, capture=capture)
    n = reused.seq_len
    weights = capture[0]  # {layer: [1, head, tail, n + tail]}
    return sum((w[0, :, :, :n].float().sum(dim=(0, 1)) for w in weights.values()),
               torch.zeros(n))  # [pos]


def aggregator_class(tok: Any, ids: Sequence[int]) -> list[int]:
    """Per token: 0 a newline, 1 other punctuation / section mark / special, 2 not an aggregator."""
    special = set(getattr(tok, "all_special_ids", []) or [])
    texts: dict[int, str] = {}
    out = []
    for i in ids:
        if i not in texts:
            texts[i] = tok.decode([i])
        t = texts[i]
        out.append(0 if "\n" in t else 1 if i in special or is_aggregator(t) else 2)
    return out


def note_positions(tok: Any, layout: Layout, fraction: float, seam: int = 0) -> list[int]:
    """Per block, budget(L_j, fraction) positions: its first `seam` tokens, then aggregators
    (newlines first, then other marks, each class spread evenly over the block)."""
    if seam < 0:
        raise ValueError(f"seam must be >= 0, got {seam}")
    chosen: list[int] = []
    for start, blk in zip(layout.starts, layout.blocks):
        k = budget(len(blk), fraction)
        first = list(range(min(seam, k, len(blk))))
        chosen += [start + i for i in first]
        k -= len(first)
        cls = aggregator_class(tok, blk)
        for c in (0, 1):
            if k <= 0:
                break
            mine = [i for i, x in enumerate(cls) if x == c and i >= len(first)]
            pick = spread(mine, k)
            chosen += [start + i for i in pick]
            k -= len(pick)
    return sorted(chosen)


# --- building the blended cache ----------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """A selection rule and its setting: seam K (tokens per block) or a fraction r of block tokens."""

    family: str
    setting: float = 0.0
    check_layer: int = 1  # CacheBlend's (and attribution's) early layer
    seam: int = 0  # note-aware: first tokens of each block bought from its budget first

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown blend method {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.family == "seam" and (self.setting < 0 or self.setting != int(self.setting)):
            raise ValueError(f"seam K must be an integer >= 0, got {self.setting}")
        if self.family in (*RANKED, "notes") and not 0.0 < self.setting <= 1.0:
            raise ValueError(f"{self.family} needs a fraction in (0, 1], got {self.setting}")
        if self.seam < 0 or (self.seam and self.family != "notes"):
            raise ValueError(f"seam={self.seam}: only note-aware repair buys seam tokens first")

    @property
    def curve(self) -> str:
        """The method as one curve of the comparison: its family, `notes+seam<S>` for the hybrid."""
        return f"notes+seam{self.seam}" if self.seam else self.family

    @property
    def name(self) -> str:
        if self.family == "naive":
            return "naive"
        if self.family == "seam":
            return f"seam@{int(self.setting)}"
        return f"{self.curve}@{round(self.setting * 100)}%"


@dataclass(frozen=True)
class Built:
    """A blended context cache, the block tokens recomputed and the tokens run through the check."""

    cache: KVCache
    recomputed: int
    checked: int = 0  # CacheBlend, attribution: context tokens prefilled through layers 0..check_layer


def build(
    model: LoadedModel,
    layout: Layout,
    prefix: KVCache | None,
    blocks: Sequence[compose.Block],
    method: Method,
) -> Built:
    """The context cache (head + blocks) under `method`, from the cached head and stored blocks."""
    if len(blocks) != len(layout.blocks):
        raise ValueError(f"{len(blocks)} stored blocks for a layout of {len(layout.blocks)}")
    if method.family == "seam":
        k = int(method.setting)
        return Built(compose.transplant(model, prefix, blocks, k), len(seam_positions(layout, k)))
    naive = compose.transplant(model, prefix, blocks, 0)
    if method.family == "naive":
        return Built(naive, 0)
    checked = 0
    if method.family in RANKED:
        if method.family == "cacheblend":
            score = key_deviation(model, naive, layout.context, method.check_layer)
        elif method.family == "attribution":
            score = answer_attribution(model, naive, layout, method.check_layer)
        else:
            score = query_attention(model, naive, layout)
        chosen = cacheblend_positions(score, layout, method.setting)
        checked = 0 if method.family == "query_aware" else len(layout.context)
    else:
        chosen = note_positions(model.tokenizer, layout, method.setting, method.seam)
    return Built(run.recompute(model, naive, layout.context, chosen), len(chosen), checked)
