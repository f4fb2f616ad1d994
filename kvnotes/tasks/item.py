"""The task item: one mutable span, two token-aligned prompts and the decision they gate.

Old and new prompts have equal length and differ only inside `field_span`, so positions
correspond 1:1 and a cache edit can be scored against a clean prefill of either. The decision
is read at `decision_pos` (the last prompt position) from the first token of each outcome;
`score = logit[correct_new] - logit[correct_old]` (for a control, whose correct outcome does
not change, the contrast is against the other outcome).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxtyping import Float
from torch import Tensor

from kvnotes.measure.score import Metric, ids_diff
from kvnotes.tasks.tokens import check_alignment


@dataclass(frozen=True)
class TaskItem:
    """A token-aligned old/new prompt pair with its decision readout and provenance."""

    item_id: str
    suite: str
    domain: str
    template_id: str  # which phrasings were drawn: grouping key for cross-validation
    seed: int
    variant: str  # field | control | polarity | trigger
    field_name: str  # the mutable slot (a field, a control field, or "trigger")
    old_value: str
    new_value: str
    old_text: str
    new_text: str
    old_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    field_span: tuple[int, int]  # [start, end) of the mutable tokens
    aggregators: tuple[int, ...]  # newline/punctuation/special positions after the field
    outcomes: tuple[str, ...]
    decision_ids: tuple[int, ...]  # first token of each outcome, this tokenizer
    correct_old: str
    correct_new: str
    polarity: int = 0  # 1 when the rule carries the inverting trigger word (old prompt)
    chat: bool = True
    segments: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    cf_ids: tuple[int, ...] | None = None  # content-free value in the span (calibration)
    score_metric: Metric | None = None  # a user's metric (task=pairs); None: the decision ids' difference

    def __post_init__(self) -> None:
        check_alignment(self.old_ids, self.new_ids, self.field_span)
        if self.cf_ids is not None:
            check_alignment(self.old_ids, self.cf_ids, self.field_span)
        if len(self.outcomes) != len(self.decision_ids) or len(set(self.decision_ids)) != len(
            self.decision_ids
        ):
            raise ValueError(f"{self.item_id}: one distinct decision id per outcome is needed")
        for c in (self.correct_old, self.correct_new):
            if c not in self.outcomes:
                raise ValueError(f"{self.item_id}: correct outcome {c!r} not in {self.outcomes}")

    # --- positions --------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return len(self.old_ids)

    @property
    def decision_pos(self) -> int:
        """The last prompt position: its logits predict the decision token."""
        return self.n_tokens - 1

    @property
    def field_end(self) -> int:
        return self.field_span[1]

    @property
    def downstream(self) -> tuple[int, int]:
        """Everything after the field: [field_end, n_tokens)."""
        return (self.field_span[1], self.n_tokens)

    # --- decision readout -------------------------------------------------------------------
    @property
    def flips(self) -> bool:
        """Whether the correct decision differs between old and new (False for controls)."""
        return self.correct_old != self.correct_new

    def index(self, outcome: str) -> int:
        return self.outcomes.index(outcome)

    @property
    def score_ids(self) -> tuple[int, int]:
        """(positive, negative) decision ids of the score: new-correct minus old-correct."""
        pos = self.index(self.correct_new)
        neg = self.index(self.correct_old)
        if pos == neg:  # control: contrast the correct outcome with the first other one
            neg = next(i for i in range(len(self.outcomes)) if i != pos)
            pos, neg = neg, pos
        return self.decision_ids[pos], self.decision_ids[neg]

    @property
    def metric(self) -> Metric:
        """What patching reads (kvnotes.measure.score): the item's own metric when it has one,
        else logit[positive] - logit[negative] of `score_ids`."""
        return self.score_metric if self.score_metric is not None else ids_diff(*self.score_ids)

    def decision_score(self, logits: Float[Tensor, "*batch vocab"]) -> Float[Tensor, "*batch"]:
        """The decision score of next-token logits of any leading shape, in fp32 (`metric`): the
        one definition every probe, strategy and experiment reads."""
        if self.score_metric is not None:
            return self.score_metric(logits)
        pos, neg = self.score_ids
        return logits[..., pos].float() - logits[..., neg].float()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("score_metric")
        d["decision_pos"] = self.decision_pos
        d["downstream"] = self.downstream
        return d
