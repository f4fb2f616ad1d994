"""Decision readout of task items: outcome logits at the decision position, old and new.

score = logit[positive] - logit[negative] with (positive, negative) = `TaskItem.score_ids`
(new-correct vs old-correct). The decision is the argmax among outcomes; *calibrated*, it is
the argmax of outcome logits minus those of the content-free prompt (the field set to "N/A",
contextual calibration), which removes a model's prior for one answer word. Calibration never
changes a score difference, so recoveries are the same either way. Old, new (and content-free)
prompts share every token before the field: that prefix is prefilled once and the suffixes run
as one batch against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine.run import extend, prefill
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem


@dataclass(frozen=True)
class ItemScore:
    """Outcome logits and scores of one item under its old and new prompt."""

    item_id: str
    outcomes: tuple[str, ...]
    logits_old: tuple[float, ...]  # one per outcome, at the decision position
    logits_new: tuple[float, ...]
    score_old: float
    score_new: float
    logits_cf: tuple[float, ...] | None = None  # content-free prompt, when the item has one

    @property
    def delta(self) -> float:
        return self.score_new - self.score_old

    @property
    def argmax_old(self) -> str:
        return self.outcomes[decide(self.logits_old)]

    @property
    def argmax_new(self) -> str:
        return self.outcomes[decide(self.logits_new)]

    def decision(self, which: str, calibrated: bool = True) -> str:
        """The outcome chosen under the old or new prompt (calibrated when possible)."""
        logits = self.logits_old if which == "old" else self.logits_new
        return self.outcomes[decide(logits, self.logits_cf if calibrated else None)]


def decide(logits: Sequence[float], cf: Sequence[float] | None = None) -> int:
    """Index of the chosen outcome: argmax of the outcome logits, minus `cf` when given."""
    vals = [x - (cf[i] if cf is not None else 0.0) for i, x in enumerate(logits)]
    return max(range(len(vals)), key=vals.__getitem__)


def outcome_logits(item: TaskItem, logits: Float[Tensor, " vocab"]) -> tuple[float, ...]:
    """Logits of each outcome's decision token (fp32)."""
    return tuple(float(logits[i]) for i in item.decision_ids)


def score(item: TaskItem, logits: Float[Tensor, " vocab"]) -> float:
    """logit[positive] - logit[negative] of the item's score contrast (`TaskItem.decision_score`)."""
    return float(item.decision_score(logits))


def decision_logits(
    model: LoadedModel, item: TaskItem, calibrate: bool = True
) -> Float[Tensor, "rows vocab"]:
    """Last-position logits of the old (row 0), new (row 1) and content-free (row 2) prompt."""
    s = item.field_span[0]
    rows = [item.old_ids, item.new_ids]
    if calibrate and item.cf_ids is not None:
        rows.append(item.cf_ids)
    batch = torch.tensor([r[s:] for r in rows])  # [rows, n - s]
    cache = prefill(model, item.old_ids[:s]).cache if s > 0 else None
    return extend(model, cache, batch).logits[:, -1]  # [rows, 1, vocab] -> [rows, vocab]


def score_item(item: TaskItem, logits: Float[Tensor, "rows vocab"]) -> ItemScore:
    return ItemScore(
        item_id=item.item_id,
        outcomes=item.outcomes,
        logits_old=outcome_logits(item, logits[0]),
        logits_new=outcome_logits(item, logits[1]),
        score_old=score(item, logits[0]),
        score_new=score(item, logits[1]),
        logits_cf=outcome_logits(item, logits[2]) if logits.shape[0] > 2 else None,
    )


def score_items(
    model: LoadedModel, items: Sequence[TaskItem], calibrate: bool = True
) -> list[ItemScore]:
    """Score every item (old, new and, with `calibrate`, content-free prompt), clean prefills."""
    return [score_item(it, decision_logits(model, it, calibrate)) for it in items]
