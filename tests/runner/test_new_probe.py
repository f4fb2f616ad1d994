"""A new probe is one file: written into a folder on the probes package's path, the runner finds
it, composes `+probe=<name>` from its dataclass alone (no yaml), validates it and runs it."""

from __future__ import annotations

import json
import textwrap

import pytest
from hydra import compose
from tiny_runs import TINY, hydra_ready  # noqa: F401

import probes
import runner.main as runner
from kvnotes.errors import ConfigError
from runner import jobs

PROBE = '''
    """Probe `echo_length`: one record per item with its token count (a test probe)."""

    from dataclasses import dataclass

    from kvnotes.models import LoadedModel


    @dataclass
    class EchoConfig:
        scale: float = 1.0

        def __post_init__(self) -> None:
            if self.scale <= 0:
                raise ValueError(f"scale must be > 0, got {self.scale}")


    def run(model: LoadedModel, items: list, cfg: EchoConfig) -> list[dict]:
        return [{"item_id": it.item_id, "value": cfg.scale * it.n_tokens} for it in items]


    def summarize(records: list[dict], cfg: EchoConfig) -> dict:
        return {"n_items": len(records)}


    NAME = "echo_length"
    CONFIG = EchoConfig
'''


@pytest.fixture
def new_probe(tmp_path, monkeypatch):
    folder = tmp_path / "more_probes"
    folder.mkdir()
    (folder / "echo_length.py").write_text(textwrap.dedent(PROBE))
    monkeypatch.setattr(probes, "__path__", [*probes.__path__, str(folder)])
    monkeypatch.setattr(jobs, "_ENTRIES", dict(jobs._ENTRIES))
    runner.prepare()  # discovery and the schemas, as at start-up
    yield
    monkeypatch.undo()
    runner.prepare()


def test_one_file_makes_a_runnable_probe(new_probe, tmp_path, tiny_llama_vocab, monkeypatch):
    import runner.context as context

    assert "echo_length" in jobs.names("probe")
    monkeypatch.setattr(context, "load", lambda cfg: tiny_llama_vocab)
    cfg = compose("config", overrides=["+probe=echo_length", "probe.scale=2", "task.n_items=2", "task.length=900",
                                       f"results_dir={tmp_path / 'runs'}", "progress=false", *TINY])
    run_dir = runner.run(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["name"] == "echo_length" and summary["n_items"] == 2
    with pytest.raises(ConfigError, match="scale must be > 0"):
        runner.run(compose("config", overrides=["+probe=echo_length", "probe.scale=-1", *TINY,
                                                f"results_dir={tmp_path / 'runs'}"]))
