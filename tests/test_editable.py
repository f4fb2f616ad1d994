"""EditableCache on a tiny model: identities and clear errors."""

import pytest
from tolerances import ATOL_FP32

from kvnotes import EditableCache, EditError, run
from kvnotes.editable import demo_prompt
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def ec():
    return EditableCache(tiny_model("llama"), demo_prompt())


def _ref(ec, ids):
    return run.prefill(ec.model, list(ids)).logits[0, -1]


@pytest.mark.parametrize("strategy", ["oracle", "full_downstream", "erratum"])
def test_cache_equals_clean_prefill_of_its_tokens(ec, strategy):
    r = ec.edit("account_role: admin", "account_role: guest", strategy=strategy, insert_before="Request:")
    assert (r.next_token_logits() - _ref(ec, r.ids)).abs().max().item() <= ATOL_FP32


def test_erratum_keeps_prefix_and_names_the_field(ec):
    r = ec.edit("account_role: admin", "account_role: guest", strategy="erratum", insert_before="Request:")
    n = len(ec._encode(demo_prompt()[: demo_prompt().index("Request:")]))
    assert r.ids[: n - 1] == ec.ids[: n - 1]
    assert "[STATE UPDATE] account_role has changed to guest" in r.text
    assert isinstance(r.generate(max_new_tokens=3), str)


def test_field_only_and_selective_recompute_little(ec):
    a = ec.edit("admin\n", "guest\n", strategy="field_only")
    b = ec.edit("admin\n", "guest\n", strategy="selective", k=4)
    assert a.recomputed < b.recomputed <= a.recomputed + 4


def test_errors_name_what_works(ec):
    with pytest.raises(EditError, match="occurs 0 times"):
        ec.edit("superuser", "guest")
    with pytest.raises(EditError, match="valid: erratum"):
        ec.edit("account_role: admin", "x", strategy="magic")
    with pytest.raises(EditError, match="erratum' or 'full_downstream"):
        ec.edit("admin\n", "a much longer role name\n", strategy="field_only")
