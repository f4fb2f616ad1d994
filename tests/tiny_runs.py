"""Shared by the experiments.run tests: a selfcheck job on a tiny random llama, composed by Hydra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import kvnotes.compose.splice
import runner.main as runner

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.name=tiny-llama", "model.tiny_family=llama"]
SMALL = ["experiment.n_blocks=3", "experiment.block_sentences=2", "experiment.prefix_sentences=1",
         "experiment.seams=[0,1,4]", "experiment.n_boot=50", "progress=false"]
ONE_THREAD = "threads=1"  # a tiny model on a shared CPU: 0.3 s a run instead of seconds of OpenMP waits


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    """Registry filled and Hydra initialised on configs/ for every test of the importing module."""
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


def selfcheck_cfg(results: Path, *overrides: str):
    return compose("config", overrides=["+experiment=selfcheck", f"results_dir={results}",
                                        *TINY, *SMALL, *overrides])


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def interrupted_run(results: Path, monkeypatch, *overrides: str) -> Path:
    """A run dir whose first attempt stopped after one of three blocks (status interrupted)."""
    real = kvnotes.compose.splice.self_check
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(kvnotes.compose.splice, "self_check", flaky)
    with pytest.raises(KeyboardInterrupt):
        runner.run(selfcheck_cfg(results, *overrides))
    monkeypatch.undo()
    (path,) = (results / "selfcheck" / "tiny-llama").iterdir()
    assert read(path / "meta.json")["status"] == "interrupted"
    return path
