"""kvnotes.compose.verify: go on every tiny family and the real llama, no-go (and a refused transplant
gate) on longrope and on a wrong rotation, the command line."""

from __future__ import annotations

import json

import pytest
import torch

from kvnotes.compose import verify
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def test_every_tiny_family_verifies_go(tiny):
    rep = verify.verify(tiny, n_probes=1)
    assert rep.go, rep.lines()
    assert not rep.real_weights  # random weights: fidelity reported, not judged
    assert rep.rope["roundtrip_rel"] < 1e-4 and rep.rope["offset_rel"] < 1e-4
    assert {s["seam"] for s in rep.splice} == set(verify.SEAMS)
    assert rep.exact["splice_full"] < 1e-4
    if tiny.adapter.family in ("mistral", "gemma2", "gemma3"):
        assert rep.rope["window_exercised"] is True  # probes outrun the 24-token window


def test_longrope_is_no_go_and_require_go_refuses_unless_forced():
    from tiny_models import longrope_model

    m = longrope_model()
    rep = verify.verify(m, n_probes=1)
    assert not rep.go and "longrope" in rep.reasons[0] and not rep.splice
    with pytest.raises(verify.NoGoError, match="longrope"):
        verify.require_go(m)
    assert verify.require_go(m, force=True) is not None


def test_a_wrong_rotation_is_caught(monkeypatch):
    """cos/sin of 2 * delta: a round trip still closes, rotate vs prefill-at-offset does not."""
    m = tiny_model("qwen2")
    real = type(m.adapter).rope_cos_sin

    def doubled(self, model, positions, layer):  # noqa: ANN001
        return real(self, model, positions * 2, layer)

    monkeypatch.setattr(type(m.adapter), "rope_cos_sin", doubled)
    rep = verify.verify(m, n_probes=1)
    assert rep.rope["roundtrip_rel"] < 1e-4
    assert not rep.go and any("offset_rel" in r for r in rep.reasons)


def test_fidelity_is_judged_against_the_stated_threshold():
    m = tiny_model("llama")
    strict = verify.Thresholds(rope_rel=1e-3, exact_atol=1e-3, cosine=0.99999)
    rep = verify.verify(m, n_probes=1, judge_fidelity=True, thresholds=strict)
    assert not rep.go and "splice cosine" in rep.reasons[0]
    assert verify.verify(m, n_probes=1, judge_fidelity=False, thresholds=strict).go
    with pytest.raises(ValueError):
        verify.verify(m, n_probes=0)


def test_require_go_runs_once_per_model(monkeypatch):
    m = tiny_model("llama")
    calls = []
    real = verify.verify
    monkeypatch.setattr(verify, "verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = verify.require_go(m, n_probes=1)
    b = verify.require_go(m, n_probes=1)
    assert a is b and a.go and len(calls) == 1


def test_a_new_model_never_inherits_a_freed_models_verdict(monkeypatch):
    """The verdict is keyed on the module, not its id(): ids of freed objects are reused."""
    import gc

    first = tiny_model("llama")
    verify.require_go(first, n_probes=1)
    assert len(verify._VERDICTS) >= 1 and first.hf in verify._VERDICTS
    del first
    gc.collect()
    calls = []
    real = verify.verify
    monkeypatch.setattr(verify, "verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    verify.require_go(tiny_model("llama"), n_probes=1)
    assert calls == [1]  # verified afresh, whatever id the new module got


def test_cli(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert verify.main(["tiny-mistral", "--probes", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verdict GO" in text and "sliding window 24" in text
    data = json.loads(out.read_text())
    assert data[0]["go"] is True and data[0]["model"] == "tiny-mistral"
    assert verify.main(["no-such-model"]) == 2
    with pytest.raises(SystemExit):
        verify.main([])


def test_report_row_and_table():
    rep = verify.verify(tiny_model("gemma2"), n_probes=1)
    row = rep.row()
    assert row.startswith("| tiny-gemma2 (tiny config) | float32 |") and row.endswith("| go |")
    head, rule = verify.TABLE_HEAD.split("\n")
    assert head.count("|") == rule.count("|") == row.count("|")


def test_real_llama_is_go(llama):
    torch.set_num_threads(1)
    rep = verify.verify(llama, n_probes=1)
    assert rep.real_weights and rep.go, rep.lines()


def test_cli_reports_each_step_on_stderr_while_it_works(capsys):
    """The command said nothing for minutes, then `verdict GO`: each step now says itself first."""
    assert verify.main(["tiny-llama", "--probes", "2"]) == 0
    cap = capsys.readouterr()
    steps = [line.split("] ", 1)[1] for line in cap.err.splitlines()]
    assert steps[0].startswith("tiny-llama: composition go / no-go") and "kvnotes models verify" in steps[0]
    assert steps[1].startswith("facts: rope type and scaling of")
    assert sum(s.startswith("rope: rotate by d = ") for s in steps) == 3
    assert [s.split(" (")[0] for s in steps if s.startswith("splice:")] == [
        "splice: probe prompt 1/2", "splice: probe prompt 2/2"]
    assert "verdict GO" in cap.out and "[" not in cap.out.splitlines()[0]  # stdout: the report alone


def test_verify_tells_progress_in_order_and_is_silent_by_default(capsys):
    seen: list[str] = []
    verify.verify(tiny_model("qwen2"), n_probes=1, progress=seen.append)
    assert [s.split(":")[0] for s in seen] == ["facts", "rope", "rope", "rope", "splice"]
    verify.verify(tiny_model("qwen2"), n_probes=1)
    assert capsys.readouterr() == ("", "")


def test_the_two_verify_commands_point_to_each_other(capsys):
    """`kvnotes verify` (composition) and `kvnotes models verify` (weights' hashes) were easy to confuse."""
    from kvnotes import cli
    from kvnotes.models.__main__ import main as models_main

    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "verify     composition go / no-go" in usage and "not the weights' hashes" in usage
    with pytest.raises(SystemExit):
        verify.main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: kvnotes verify") and "kvnotes models verify NAME" in text
    with pytest.raises(SystemExit):
        verify.main([])
    assert "the weights' hashes: kvnotes models verify NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        models_main(["verify", "--help"])
    assert "not the composition go / no-go: kvnotes verify MODEL" in " ".join(capsys.readouterr().out.split())
    assert models_main(["verify", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model" in err and "the composition go / no-go of a model is `kvnotes verify MODEL`" in err
