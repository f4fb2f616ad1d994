"""The usability margin of a model, derived from its own scores by a rule fixed in advance.

An item measures recovery only when the model's decision moves with the field:
|score_new - score_old| >= margin. A fixed margin (1.0 logit) suits a 1.5B model and leaves a
135M one with no item at all; a margin read off the recoveries would be circular. So the margin
is derived from what an *irrelevant* change does to the same model's score:

    margin = max(K_SIGMA * RMS, MIN_STEPS * step(dtype))

RMS is the root mean square of score_new - score_old over the `gated-control` items (request_id
or current_time changes; the correct action must not), with the same model, dtype, prompt length
and seed as the runs it serves; step(dtype) is the score resolution of the dtype (bfloat16 1/16
logit). K_SIGMA = 3: a field that did nothing passes with the chance of a 3-sigma excursion of
the control shifts, and a perturbation of control size moves a usable item's recovery by at most
1/3. MIN_STEPS = 8: a usable denominator spans at least 8 dtype steps, so recovery is resolved
to 1/8 or better. Both constants were fixed before any control score was looked at.

`DERIVED` records the derivation behind each registered model's margin (configs/model/<name>.yaml
and the registry carry the number; a test checks they agree). `describe` states the rule for a
run's summary; `python -m analysis.margin <validate_tasks gated-control run>` derives it anew.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

K_SIGMA = 3.0
MIN_STEPS = 8
RULE = (f"margin = max({K_SIGMA:g} x RMS of score_new - score_old over gated-control items "
        f"(an irrelevant field changed), {MIN_STEPS} score steps of the dtype), rounded up to 0.01")
STEPS = {"bfloat16": 1 / 16, "float16": 1 / 128, "float32": 2.0**-20}


def score_step(dtype: str) -> float:
    """Resolution of a score (a logit difference) in `dtype`: bfloat16 1/16, float16 1/128 at
    logits of magnitude 8-16; float32 2^-20 (negligible)."""
    key = str(dtype).removeprefix("torch.")
    if key not in STEPS:
        raise ValueError(f"no score step for dtype {dtype!r}; known: {', '.join(STEPS)}")
    return STEPS[key]


@dataclass(frozen=True)
class Derivation:
    """A margin and the control measurement it came from."""

    margin: float
    rms: float  # RMS of score_new - score_old over the control items
    n_control: int
    dtype: str
    source: str = ""  # the command (and commit) of the control run

    def __post_init__(self) -> None:
        if not (self.margin > 0 and self.rms >= 0 and self.n_control > 0):
            raise ValueError(f"a derivation needs margin > 0, rms >= 0, n_control > 0: {self}")


def derive(control_deltas: ArrayLike | Sequence[float], dtype: str, source: str = "") -> Derivation:
    """The margin of `RULE` from the score shifts of control items (finite values only)."""
    d = np.asarray(control_deltas, dtype=np.float64).ravel()
    d = d[np.isfinite(d)]
    if d.size < 12:
        raise ValueError(f"{d.size} control deltas; the rule needs at least 12 control items")
    rms = float(np.sqrt(np.mean(d * d)))
    raw = max(K_SIGMA * rms, MIN_STEPS * score_step(dtype))
    return Derivation(margin=math.ceil(raw * 100 - 1e-9) / 100, rms=rms, n_control=int(d.size),
                      dtype=str(dtype).removeprefix("torch."), source=source)


# Per registered model: the derivation behind its configured margin (float32 at 400 tokens,
# seed 0, 48 gated-control items). Models without an entry keep a margin set by hand.
DERIVED: dict[str, Derivation] = {
    "llama": Derivation(margin=0.03, rms=0.009902, n_control=48, dtype="float32",
        source="validate_tasks gated-control, 400 tokens, seed 0, commit 1cbd107"),
    "qwen-1.5b": Derivation(margin=0.03, rms=0.007103, n_control=48, dtype="float32",
        source="validate_tasks gated-control, 400 tokens, seed 0, commit 1cbd107"),
    "qwen": Derivation(margin=0.02, rms=0.004574, n_control=48, dtype="float32",
        source="validate_tasks gated-control, 400 tokens, seed 0, commit 1cbd107"),
    "gemma": Derivation(margin=0.02, rms=0.005389, n_control=48, dtype="float32",
        source="validate_tasks gated-control, 400 tokens, seed 0, commit 1cbd107"),
}

HAND_MARGIN = 1.0  # a model without a recorded derivation, until one is derived


def unusable(delta: float, margin: float) -> str | None:
    """The usable-item gate, the one place it is decided: why a pair cannot measure recovery
    (|score_new - score_old| below the margin, or not a number), else None. Below the margin a
    recovery divides by a difference of noise size: 14 or -13 say nothing."""
    if not abs(delta) >= margin:
        return f"|score_new - score_old| = {abs(delta):.3g} < margin {margin:g}"
    return None


def margin_of(model: str) -> float:
    """The margin a model's runs judge items by unless the run overrides it (model.margin=X):
    its recorded derivation, else HAND_MARGIN. The one source of the number (the registry's
    ModelSpec.margin, the runner's model config and the probes all read it from here)."""
    d = DERIVED.get(model)
    return d.margin if d is not None else HAND_MARGIN


def describe(model: str, dtype: str, margin: float) -> str:
    """One line for a summary: the margin, where it came from, and the rule."""
    d = DERIVED.get(model)
    if d is None or not math.isclose(d.margin, margin, abs_tol=1e-9):
        how = ("set by hand (no derivation recorded for this model)" if d is None else
               f"set by hand (the rule gives {d.margin:g} for {model})")
        return f"margin {margin:g}: {how}; rule to derive one: {RULE}"
    where = f" ({d.source})" if d.source else ""
    same = "" if d.dtype == dtype or not dtype else f"; derived in {d.dtype}, this run is {dtype}"
    return (f"margin {margin:g}: derived, {RULE}; control RMS {d.rms:.3g} over {d.n_control} "
            f"items in {d.dtype}{where}{same}")


def no_usable_hint(n_items: int, margin: float | Sequence[float], largest: float) -> str:
    """The one line a run with no usable item prints instead of a table of NaN."""
    m = margin if isinstance(margin, int | float) else max(margin, default=float("nan"))
    top = f"; the largest was {largest:.3g}" if math.isfinite(largest) else ""
    return (f"no usable item: none of {n_items} moved the decision by |score_new - score_old| >= "
            f"margin {m:g}{top}. Try a model that conditions on the field (qwen-1.5b), a margin "
            f"derived by the rule (python -m analysis.margin <gated-control validate_tasks run>), "
            f"or a task that puts the value near the question (kvnotes/tasks/README.md, Measurements).")
