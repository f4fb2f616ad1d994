"""Edit strategies: bring a stale KV cache in line with a changed field, at a chosen cost.

The stale cache holds the old prompt; the oracle is a clean prefill of the new one. Because the
model memoises the field's consequence in downstream note tokens, rewriting the field's own K/V
(field-only) barely moves the decision, recomputing everything after the field (full-downstream)
fixes it, and the cheap fixes either recompute the field plus K chosen note positions
(selective@K: `copy` pastes the oracle's K/V, an upper bound; `recompute` runs those tokens
against their stale neighbours, what a real system can do) or leave the cache alone and append an
erratum line (the prefix stays byte-identical). Every builder returns an `EditState`: the edited
token ids, the decision logits, what it recomputed, and how long it took beyond the stale cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine.cache import KVCache, absolute_positions, patch
from kvnotes.engine.partial import early_keys
from kvnotes.engine.run import extend, prefill, recompute_extend
from kvnotes.engine.variants import read_variants
from kvnotes.measure.timing import timed
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.tokens import encode

ERRATA: dict[str, str] = {
    "explicit": "[STATE UPDATE] {field} has changed to {value}; this overrides any earlier value. "
    "Apply the current value.",
    "bare": "{field}: {value}",
    "tagged": "[STATE UPDATE] {field}: {value}",
    "reevaluate": "[STATE UPDATE] {field} has changed to {value}. Disregard your earlier "
    "conclusion and re-evaluate.",
}


@dataclass(frozen=True)
class EditState:
    """Result of one strategy on one item."""

    strategy: str
    logits: Float[Tensor, " vocab"]  # decision logits (fp32)
    recomputed: int  # tokens run through the model beyond the stale cache
    total: int  # tokens of the edited sequence
    seconds: float  # wall time of the edit + decision read, the stale cache given
    ids: tuple[int, ...] = ()  # the edited token sequence (erratum variants differ from old)
    cache: KVCache | None = None  # the edited cache over at least ids[:-1]

    @property
    def recompute_fraction(self) -> float:
        return self.recomputed / self.total if self.total else float("nan")


def erratum_text(item: TaskItem, wording: str = "explicit", template: str | None = None) -> str:
    """The erratum line for an item; `template` (with {field} and {value}) overrides `wording`."""
    if template is None:
        if wording not in ERRATA:
            raise KeyError(f"unknown erratum wording {wording!r}; valid: {', '.join(ERRATA)}")
        template = ERRATA[wording]
    return template.format(field=item.field_name, value=item.new_value.strip()) + "\n"


def erratum_position(item: TaskItem) -> int:
    """Where the erratum goes: before the request (the question), else before the task line."""
    for seg in ("request", "task", "turn_answer", "answer_prefix"):
        if seg in item.segments:
            return int(item.segments[seg][0])
    return item.decision_pos


Built = tuple[Tensor, int, tuple[int, ...], KVCache]  # logits, recomputed, ids, cache


def _timed(fn: Callable[[], Built], name: str, total: int, device: torch.device) -> EditState:
    """Build a state with its wall time, the device synchronised at both ends (kvnotes.measure.timing)."""
    with timed(device) as t:
        logits, recomputed, ids, cache = fn()
    return EditState(name, logits, recomputed, total, t.seconds, ids, cache)


class Editor:
    """Builds edit states of one item from its stale cache (positions 0..n-2; the last token is the tail)."""

    def __init__(self, model: LoadedModel, item: TaskItem, stale: KVCache | None = None) -> None:
        self.model, self.item = model, item
        self.n = item.n_tokens
        self.tail = torch.tensor([item.old_ids[-1:]])
        self.stale = stale if stale is not None else prefill(model, item.old_ids[:-1]).cache
        self._oracle: KVCache | None = None
        self._by_effect: list[int] | None = None

    @property
    def oracle_cache(self) -> KVCache:
        if self._oracle is None:
            self._oracle = prefill(self.model, self.item.new_ids[:-1]).cache
        return self._oracle

    def content_free_logits(self) -> Tensor | None:
        """Decision logits of the content-free prompt (field set to N/A), for calibrated picks."""
        if self.item.cf_ids is None:
            return None
        s = self.item.field_span[0]
        return extend(self.model, self.stale.slice(0, s), self.item.cf_ids[s:]).logits[0, -1]

    def _read(self, cache: KVCache, recomputed: int, ids: Sequence[int]) -> Built:
        return extend(self.model, cache, self.tail).logits[0, -1], recomputed, tuple(ids), cache

    # --- strategies -------------------------------------------------------------------------
    def full_prefill(self) -> EditState:
        """Reference cost: a clean prefill of the whole new prompt (the oracle, timed)."""
        def build() -> Built:
            step = prefill(self.model, self.item.new_ids)
            return step.logits[0, -1], self.n, self.item.new_ids, step.cache

        return _timed(build, "oracle", self.n, self.model.device)

    def stale_state(self) -> EditState:
        return _timed(lambda: self._read(self.stale, 1, self.item.old_ids), "stale", self.n, self.model.device)

    def selective(self, positions: Sequence[int], mode: str = "recompute", name: str | None = None) -> EditState:
        """Recompute `positions` (the field always included; negative ones count from the end of the
        stale cache) against stale neighbours, or copy them."""
        given = absolute_positions(list(positions), self.stale.seq_len).tolist()
        pos = sorted(set(range(*self.item.field_span)) | set(given))
        if mode not in ("recompute", "copy"):
            raise ValueError(f"mode {mode!r}; valid: recompute, copy")

        def build() -> Built:
            if mode == "copy":
                return self._read(patch(self.stale, self.oracle_cache, pos), len(pos) + 1, self.item.new_ids)
            step = recompute_extend(self.model, self.stale, self.item.new_ids[:-1], pos, self.tail)
            return step.logits[0, -1], len(pos) + 1, tuple(self.item.new_ids), step.cache

        return _timed(build, name or f"selective_{mode}", self.n, self.model.device)

    def field_only(self) -> EditState:
        return self.selective([], "recompute", "field_only")

    def full_downstream(self) -> EditState:
        start = self.item.field_span[0]

        def build() -> Built:
            step = extend(self.model, self.stale.slice(0, start), self.item.new_ids[start:])
            return step.logits[0, -1], self.n - start, self.item.new_ids, step.cache

        return _timed(build, "full_downstream", self.n, self.model.device)

    def erratum_ids(self, wording: str = "explicit", template: str | None = None,
                    with_field: bool = False) -> tuple[int, list[int]]:
        """(at, rest): the erratum goes at position `at`, and `rest` (the erratum's tokens, then the
        prompt from `at` on) is what runs after the stale prefix [0, at)."""
        item, at = self.item, erratum_position(self.item)
        err = encode(self.model.tokenizer, erratum_text(item, wording, template))
        base_ids = item.new_ids if with_field else item.old_ids
        return at, list(err) + list(base_ids[at:])

    def erratum(self, wording: str = "explicit", template: str | None = None, with_field: bool = False) -> EditState:
        """Append the erratum before the question (stale prefix reused), optionally after a field-only edit."""
        item = self.item
        at, rest = self.erratum_ids(wording, template, with_field)
        base_ids = item.new_ids if with_field else item.old_ids
        ids = tuple(base_ids[:at]) + tuple(rest)
        span = range(*item.field_span)

        def build() -> Built:
            prefix = self.stale.slice(0, at)
            fixed = list(span) if with_field else []  # the field recomputed in the same forward
            step = recompute_extend(self.model, prefix, item.new_ids[:at], fixed, rest)
            return step.logits[0, -1], len(rest) + len(fixed), ids, step.cache

        name = ("field_erratum" if with_field else "erratum") + ("" if wording == "explicit" and template is None else f"_{wording}")
        return _timed(build, name, len(ids), self.model.device)

    def hoist(self) -> EditState:
        """The field's line moved (with the new value) to just before the question.

        The cache is reused up to the line's old start; everything after it is recomputed.
        """
        item, tok = self.item, self.model.tokenizer
        newline = [i for i, t in enumerate(item.old_ids) if "\n" in tok.decode([t])]
        start = max([i + 1 for i in newline if i < item.field_span[0]], default=item.field_span[0])
        end = min([i + 1 for i in newline if i >= item.field_span[1] - 1], default=item.field_span[1])
        at = erratum_position(item)
        if not start <= item.field_span[0] < end <= at:
            raise ValueError(f"{item.item_id}: cannot hoist: the field line must precede the question")
        old, line = list(item.old_ids), list(item.new_ids[start:end])
        ids = tuple(old[:start] + old[end:at] + line + old[at:])

        def build() -> Built:
            step = extend(self.model, self.stale.slice(0, start), list(ids[start:]))
            return step.logits[0, -1], len(ids) - start, ids, step.cache

        return _timed(build, "hoist", len(ids), self.model.device)

    def rank_by_attention(self) -> list[int]:
        """Downstream positions by the decision token's attention on the stale cache (no oracle needed)."""
        cap: list[dict[int, Tensor]] = []
        read_variants(self.model, self.stale, self.stale, [[]], self.tail, capture=cap)
        w = torch.stack([cap[0][layer][0, :, -1, : self.stale.seq_len] for layer in sorted(cap[0])])
        score = w.mean((0, 1))  # [pos]
        down = list(range(self.item.field_span[1], self.stale.seq_len))
        return [down[i] for i in torch.argsort(score[down], descending=True, stable=True).tolist()]

    def rank_by_effect(self, batch_size: int | None = None) -> list[int]:
        """Downstream positions by their single-position patching effect (needs the oracle; memoised)."""
        if self._by_effect is None:
            self._by_effect = self._rank_by_effect(batch_size)
        return list(self._by_effect)

    def _rank_by_effect(self, batch_size: int | None) -> list[int]:
        """Most recovering first: the score moved toward the oracle's by pasting that one position.

        The stale and oracle reads ride in the same batch (variants [] and all positions), so the
        direction is the item's own: effect = (score_p - score_stale) * sign(score_oracle - score_stale).
        """
        down = list(range(self.item.field_span[1], self.stale.seq_len))
        variants = [[], list(range(self.stale.seq_len)), *[[p] for p in down]]
        logits = read_variants(self.model, self.stale, self.oracle_cache, variants, self.tail,
                               batch_size=batch_size)[:, -1].float()
        score = self.item.decision_score(logits)
        stale, oracle = score[0], score[1]
        effect = (score[2:] - stale) * (1.0 if oracle >= stale else -1.0)
        return [down[i] for i in torch.argsort(effect, descending=True, stable=True).tolist()]

    def cacheblend(self, fraction: float = 0.15, check_layer: int = 1) -> EditState:
        """CacheBlend-style: recompute the `fraction` of tokens whose keys deviate most at `check_layer`."""
        def build() -> Built:
            fresh = early_keys(self.model, self.item.new_ids[:-1], check_layer)  # [1, kv, pos, d]
            dev = (fresh.float() - self.stale.keys[check_layer].float()).norm(dim=-1).sum(1)[0]  # [pos]
            k = max(1, round(fraction * self.stale.seq_len))
            top = torch.argsort(dev, descending=True)[:k].tolist()
            chosen = sorted(set(top) | set(range(*self.item.field_span)))
            step = recompute_extend(self.model, self.stale, self.item.new_ids[:-1], chosen, self.tail)
            recomputed = k + 1 + self.n * (check_layer + 1) // self.model.n_layers
            return step.logits[0, -1], recomputed, tuple(self.item.new_ids), step.cache

        return _timed(build, f"cacheblend@{round(fraction * 100)}%", self.n, self.model.device)

    def cot(self, state: EditState, max_new_tokens: int = 48, cue: str = "Let me check the rule "
            "against the current values step by step.\n") -> tuple[Tensor, str]:
        """Decision after a bounded greedy reasoning generated from the edited cache.

        The cache is cut before the answer prefix ("Next action:"), the cue and up to
        `max_new_tokens` greedy tokens run against it, then the answer prefix, whose last
        logits give the decision. Returns (decision logits, generated reasoning).
        """
        if state.cache is None:
            raise ValueError(f"state {state.strategy!r} carries no cache")
        tok = self.model.tokenizer
        a = int(self.item.segments.get("answer_prefix", (self.n - 1,))[0])
        answer = list(state.ids[len(state.ids) - (self.n - a):])  # identical in every state
        cut = len(state.ids) - len(answer)
        step = extend(self.model, state.cache.slice(0, cut), encode(tok, cue))
        cfg_eos = getattr(getattr(self.model.hf, "generation_config", None), "eos_token_id", None)
        eos = {tok.eos_token_id} | set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        gen: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(step.logits[0, -1].argmax())
            if nxt in eos:
                break
            gen.append(nxt)
            step = extend(self.model, step.cache, [nxt])
        text = tok.decode(gen)
        step = extend(self.model, step.cache, encode(tok, "\n") + answer)
        return step.logits[0, -1], text
