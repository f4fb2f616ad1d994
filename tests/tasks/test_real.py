"""Validation figures on real models, asserted against thresholds.

llama (SmolLM2-135M) barely conditions on the field (README table: mean |delta| ~0.1): the
test checks the bookkeeping (every item usable or skipped with a reason, margin reported).
qwen-1.5b is the packaged model that does condition: on a small gated suite most items clear
the 1.0 margin and the calibrated decision follows the field (slow: ~2-5 min on 2 CPU cores).
"""

from __future__ import annotations

import os

import pytest

from kvnotes.models import WeightsError, load_model
from kvnotes.tasks import build_suite, select_usable, summarize, validate


@pytest.mark.real
def test_validation_bookkeeping_on_llama(llama):
    items = build_suite("gated", llama.tokenizer, chat=llama.chat, n_items=4, length=300)
    recs = validate(llama, items, margin=1.0)
    s = summarize(recs)
    assert s["n_items"] == 4 and s["margin"] == 1.0 and s["readout"] == ["calibrated"]
    assert s["n_usable"] + sum(s["skipped_recovery"].values()) == 4
    assert s["n_usable_correct"] + sum(s["skipped_correct"].values()) == 4
    assert s["overall"]["mean_abs_delta"] < 1.0  # the 135M model does not condition (README)
    sel = select_usable(items, recs, "recovery")
    assert len(sel.items) + sum(sel.skipped.values()) == 4


@pytest.fixture(scope="module")
def qwen15(request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("loads qwen-1.5b (3 GB) and takes minutes: run with -m slow")
    try:
        return load_model("qwen-1.5b", device="cpu", dtype="bfloat16")
    except WeightsError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


@pytest.mark.real
@pytest.mark.slow
def test_qwen15_conditions_on_the_field(qwen15):
    """8 items (4 domains x both old values), 400 tokens: thresholds below the measured figures
    (README: 12 items of these designs gave mean |delta| 1.9-2.2, usable 9-10 of 12)."""
    items = build_suite("gated", qwen15.tokenizer, chat=True, n_items=8, length=400,
                        domains=["access", "loan", "shipment", "visa"])
    s = summarize(validate(qwen15, items, margin=1.0))
    o = s["overall"]
    assert o["mean_abs_delta"] >= 1.0
    assert s["n_usable"] >= 5
    assert s["n_usable_correct"] >= 4
    assert o["accuracy_old"] >= 0.6 and o["accuracy_new"] >= 0.6 and o["flip_rate"] >= 0.5
