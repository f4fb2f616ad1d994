"""A prompt pair of your own: the two prompts, the field where they differ, and a metric.

Patching needs position-for-position prompts: the corrupt prompt's cache is the base, K/V from
the clean prompt are put at chosen positions, and the metric is read after the last token (which
both prompts share). So the two prompts must tokenize to the same length and differ in one
contiguous run of tokens, the field; everything after the field is where notes can be. Recovery
is then (score - corrupt) / (clean - corrupt): 0 behaves like the corrupt prompt, 1 like the clean.
In the library's own words `old` is the corrupt prompt and `new` the clean one, as in a stale
cache and its oracle; a task suite's `TaskItem` is such a pair (`Pair.from_item`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from kvnotes.errors import ConfigError
from kvnotes.measure.score import Metric, resolve
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.tokens import aggregator_positions

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]
Where = str | tuple[int, int]  # a substring of the clean text, or a character span ([start, end))


class PairError(ConfigError):
    """A prompt pair that cannot be patched position by position; the message says what is supported."""


@dataclass(frozen=True)
class Pair:
    """Two token-aligned prompts (corrupt = old, clean = new), the field span, named spans and a metric."""

    old_ids: tuple[int, ...]  # the corrupt prompt: its cache is the base
    new_ids: tuple[int, ...]  # the clean prompt: patched K/V come from its run
    field_span: tuple[int, int]  # [start, end) of the tokens that differ
    metric: Metric
    item_id: str = "pair"
    cluster: str | None = None  # items that share a template or conversation: the cluster interval's unit
    segments: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # named token spans
    old_text: str | None = None
    new_text: str | None = None
    aggregators: tuple[int, ...] = ()  # newline / punctuation positions after the field

    def __post_init__(self) -> None:
        if len(self.old_ids) != len(self.new_ids):
            raise PairError(f"{self.item_id}: the prompts have {len(self.old_ids)} and {len(self.new_ids)} tokens")
        s, e = self.field_span
        if not 0 <= s < e < len(self.old_ids):
            raise PairError(f"{self.item_id}: the field {self.field_span} must lie inside the prompt and end "
                            f"before its last token (position {len(self.old_ids) - 1}, which reads the metric)")
        for name, (a, b) in self.segments.items():
            if not 0 <= a < b <= len(self.old_ids):
                raise PairError(f"{self.item_id}: span {name!r} {(a, b)} is outside the prompt's "
                                f"{len(self.old_ids)} tokens")

    # --- the names TaskItem users know -------------------------------------------------------
    @property
    def clean_ids(self) -> tuple[int, ...]:
        return self.new_ids

    @property
    def corrupt_ids(self) -> tuple[int, ...]:
        return self.old_ids

    @property
    def n_tokens(self) -> int:
        return len(self.old_ids)

    @property
    def decision_pos(self) -> int:
        return self.n_tokens - 1

    @property
    def domain(self) -> str:
        """The cluster of the cluster interval (the pair itself when none is given)."""
        return self.cluster or self.item_id

    def decision_score(self, logits: Tensor) -> Tensor:
        return self.metric(logits)

    @staticmethod
    def from_item(item: TaskItem) -> Pair:
        """A task suite's item as a Pair (the metric is its decision score)."""
        return Pair(item.old_ids, item.new_ids, item.field_span, item.metric, item.item_id, item.domain,
                    dict(item.segments), item.old_text, item.new_text, item.aggregators)

    @staticmethod
    def from_prompts(
        model_or_tokenizer: Any,
        clean: Prompt,
        corrupt: Prompt,
        answers: Sequence[str] | None = None,
        metric: Metric | Callable[[Tensor], Tensor] | str | None = None,
        field: Where | None = None,
        spans: Mapping[str, Where] | None = None,
        pair_id: str = "pair",
        cluster: str | None = None,
    ) -> Pair:
        """A pair from two strings, two chat-message lists or two token-id sequences.

        Strings are tokenized as written (no BOS added), messages with the model's chat template
        and its generation prompt, ids not at all. The field is where the two prompts differ
        unless `field` names it (a substring of the clean text, or a character span; token
        spans for ids); `spans` name more spans the same way (the notes default to everything
        after the field). `answers=(a, b)`: the metric is logit(a) - logit(b), a the answer the
        clean prompt should give; or `metric` a built-in name or a callable on next-token logits.
        """
        tok = getattr(model_or_tokenizer, "tokenizer", model_or_tokenizer)
        new_text, new_ids, new_off = _render(tok, clean, "clean")
        old_text, old_ids, _ = _render(tok, corrupt, "corrupt")
        found = _difference(old_ids, new_ids, pair_id)
        span = found if field is None else _tokens(field, new_text, new_off, "field", pair_id)
        if not (span[0] <= found[0] and found[1] <= span[1]):
            raise PairError(f"{pair_id}: the prompts differ at tokens {list(found)}, outside the field "
                            f"{list(span)} given: only the field may differ")
        named = {k: _tokens(v, new_text, new_off, k, pair_id) for k, v in (spans or {}).items()}
        m = resolve(metric, tok, answers, new_text)
        aggs = aggregator_positions(tok, new_ids, span[1]) if tok is not None else ()
        return Pair(tuple(old_ids), tuple(new_ids), span, m, pair_id, cluster, named, old_text, new_text,
                    tuple(p for p in aggs if p < len(new_ids) - 1))


def _render(tok: Any, prompt: Prompt, which: str) -> tuple[str | None, list[int], list[tuple[int, int]] | None]:
    """(text, ids, character offsets of each token) of one prompt; ids are taken as they are."""
    if isinstance(prompt, str):
        text = prompt
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        if tok is None or not getattr(tok, "chat_template", None):
            raise PairError(f"the {which} prompt is a message list, but the tokenizer has no chat template: "
                            "pass the prompt as text")
        messages = [dict(m) for m in prompt if isinstance(m, Mapping)]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif prompt and all(isinstance(i, int) for i in prompt):
        return None, [int(i) for i in prompt if isinstance(i, int)], None
    else:
        raise PairError(f"the {which} prompt must be a string, a list of chat messages or a list of token ids")
    if tok is None:
        raise PairError("text prompts need a tokenizer: pass the model (or its tokenizer)")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=bool(getattr(tok, "is_fast", False)))
    offsets = [tuple(o) for o in enc["offset_mapping"]] if "offset_mapping" in enc else None
    return text, list(enc["input_ids"]), offsets


def _difference(old: Sequence[int], new: Sequence[int], pair_id: str) -> tuple[int, int]:
    """[first, last + 1) of the tokens where the prompts differ; one contiguous run is supported."""
    if len(old) != len(new):
        raise PairError(f"{pair_id}: clean and corrupt tokenize to {len(new)} and {len(old)} tokens; patching "
                        "goes position by position, so choose field values of equal token length")
    diff = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    if not diff:
        raise PairError(f"{pair_id}: clean and corrupt are the same tokens")
    runs = sum(1 for j, i in enumerate(diff) if j == 0 or i != diff[j - 1] + 1)
    if runs > 1:
        raise PairError(f"{pair_id}: the prompts differ in {runs} places (tokens {diff[:8]}{'...' if len(diff) > 8 else ''}); "
                        "one contiguous field is supported: give field=<a span covering them all> to patch it as one")
    return diff[0], diff[-1] + 1


def _tokens(where: Where, text: str | None, offsets: list[tuple[int, int]] | None, name: str,
            pair_id: str) -> tuple[int, int]:
    """Token span [a, b) of a substring or character span of the clean text (token span for ids)."""
    if text is None:
        if isinstance(where, str):
            raise PairError(f"{pair_id}: span {name!r} is a substring, but the prompts were given as ids: "
                            "give a token span (start, end)")
        return int(where[0]), int(where[1])
    if isinstance(where, str):
        at = text.find(where)
        if at < 0 or not where:
            raise PairError(f"{pair_id}: span {name!r} = {where!r} is not in the clean prompt")
        if text.find(where, at + 1) >= 0:
            raise PairError(f"{pair_id}: span {name!r} = {where!r} occurs more than once in the clean prompt; "
                            "give a longer substring or a character span")
        lo, hi = at, at + len(where)
    else:
        lo, hi = int(where[0]), int(where[1])
        if not 0 <= lo < hi <= len(text):
            raise PairError(f"{pair_id}: character span {name!r} {(lo, hi)} is outside the prompt's {len(text)} characters")
    if offsets is None:
        raise PairError(f"{pair_id}: text spans need a fast tokenizer (character offsets); give token spans")
    hit = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    if not hit:
        raise PairError(f"{pair_id}: span {name!r} covers no token")
    return hit[0], hit[-1] + 1
