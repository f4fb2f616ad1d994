"""Edit strategies: exact identities that must hold whatever the model."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes import tasks
from kvnotes.edit.strategies import ERRATA, Editor, erratum_position
from kvnotes.engine import run
from kvnotes.engine.cache import patch
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    m = tiny_model(request.param)
    item = tasks.build_suite("gated", m.tokenizer, chat=False, n_items=1, length=700, seed=0)[0]
    return m, item, Editor(m, item)


def _same(a, b):
    return (a.logits - b.logits).abs().max().item() <= ATOL_FP32


def test_copy_all_downstream_equals_full_downstream(setup):
    m, item, ed = setup
    down = list(range(item.field_span[1], item.n_tokens - 1))
    assert _same(ed.selective(down, "copy"), ed.full_downstream())


def test_recompute_all_downstream_equals_full_downstream(setup):
    m, item, ed = setup
    down = list(range(item.field_span[1], item.n_tokens - 1))
    full = ed.full_downstream()
    assert _same(ed.selective(down, "recompute"), full)
    assert _same(full, ed.full_prefill())  # full-downstream is the oracle


def test_field_only_recompute_equals_copy(setup):
    m, item, ed = setup
    assert _same(ed.field_only(), ed.selective([], "copy"))


def test_erratum_equals_clean_prefill_of_the_same_tokens(setup):
    m, item, ed = setup
    at = erratum_position(item)
    for wording in ERRATA:
        st = ed.erratum(wording)
        ref = run.prefill(m, list(st.ids)).logits[0, -1]
        assert (st.logits - ref).abs().max().item() <= ATOL_FP32
        assert st.ids[:at] == tuple(item.old_ids[:at])  # prefix byte-identical
        assert st.ids[-(item.n_tokens - at):] == tuple(item.old_ids[at:])  # appended only


def test_field_erratum_is_field_edit_then_append(setup):
    """field+erratum: the field's K/V as in the new prompt, the notes stale, the erratum appended.

    Not a clean prefill of any token sequence (the notes after the field stay stale): compared
    with that construction built from clean prefills and a patch.
    """
    from kvnotes.engine.cache import patch

    m, item, ed = setup
    at = erratum_position(item)
    st = ed.erratum(with_field=True)
    span = list(range(*item.field_span))
    edited = patch(run.prefill(m, item.old_ids[:at]).cache, run.prefill(m, item.new_ids[:at]).cache, span)
    ref = run.extend(m, edited, list(st.ids[at:])).logits[0, -1]
    assert (st.logits - ref).abs().max().item() <= ATOL_FP32
    assert st.ids[:at] == tuple(item.new_ids[:at])


def test_hoist_moves_the_field_line_before_the_question(setup):
    m, item, ed = setup
    st = ed.hoist()
    assert len(st.ids) == item.n_tokens and sorted(st.ids) == sorted(item.old_ids[: item.field_span[0]] + item.new_ids[item.field_span[0]:])
    at = erratum_position(item)
    assert item.new_value.strip() in m.tokenizer.decode(list(st.ids[at - 40 : at]))  # just before the question
    ref = run.prefill(m, list(st.ids)).logits[0, -1]
    assert (st.logits - ref).abs().max().item() <= ATOL_FP32


def test_cacheblend_and_rankings_run(setup):
    m, item, ed = setup
    st = ed.cacheblend(0.15, 1)
    assert 0 < st.recompute_fraction < 1
    down = set(range(item.field_span[1], item.n_tokens - 1))
    assert set(ed.rank_by_attention()) == down and set(ed.rank_by_effect()) == down


def test_unknown_wording_lists_valid():
    m = tiny_model("llama")
    item = tasks.build_suite("gated", m.tokenizer, chat=False, n_items=1, length=700, seed=0)[0]
    with pytest.raises(KeyError, match="valid: explicit"):
        Editor(m, item).erratum("polite")
    assert torch.is_tensor(Editor(m, item).stale_state().logits)


def test_rank_by_effect_puts_the_most_recovering_position_first(setup):
    m, item, ed = setup
    order = ed.rank_by_effect()
    a, b = item.score_ids

    def score(cache):
        logits = run.extend(m, cache, ed.tail).logits[0, -1]
        return float(logits[a] - logits[b])

    s_stale, s_oracle = score(ed.stale), score(ed.oracle_cache)
    sign = 1.0 if s_oracle >= s_stale else -1.0
    effect = {p: (score(patch(ed.stale, ed.oracle_cache, [p])) - s_stale) * sign
              for p in (order[0], order[1], order[-1])}
    assert effect[order[0]] >= effect[order[1]] - 1e-5 and effect[order[0]] >= effect[order[-1]] - 1e-5
    assert effect[order[0]] > effect[order[-1]]


def test_edit_times_are_device_synchronised(setup, monkeypatch):
    """Every strategy's time waits for the device at both ends (CUDA runs asynchronously)."""
    import kvnotes.measure.timing

    m, _, ed = setup
    seen = []
    monkeypatch.setattr(kvnotes.measure.timing, "synchronize", lambda device: seen.append(torch.device(device)))
    state = ed.erratum()
    assert seen == [m.device, m.device] and state.seconds > 0
