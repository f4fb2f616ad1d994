"""Every numeric key bounded before the run dir exists (issue #36): a seed numpy refuses, a NaN
margin, a bootstrap of zero resamples are one ConfigError, and nothing is written."""

from __future__ import annotations

import pytest
from hydra import compose
from tiny_runs import TINY, hydra_ready, selfcheck_cfg  # noqa: F401

import runner.main as runner
from runner.config import ConfigError

# --- 7. numbers bounded before the run dir exists -------------------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    ("seed=-1", "seed must be in [0, 4294967295], got -1"),
    ("seed=99999999999", "seed must be in [0, 4294967295], got 99999999999"),
    ("experiment.n_boot=0", "experiment.n_boot must be >= 1, got 0"),
    ("experiment.atol=nan", "experiment.atol must be a finite number, got nan"),
    ("probe.margin=nan", "probe.margin must be a finite number, got nan"),
    ("probe.n_boot=0", "probe.n_boot must be >= 1, got 0"),
    ("task.seed=99999999999", "task.seed must be in [0, 4294967295], got 99999999999"),
])
def test_out_of_range_numbers_are_refused_before_the_run_dir(tmp_path, override, message):
    job = (["+probe=patching", f"results_dir={tmp_path / 'runs'}", *TINY, "progress=false"]
           if override.startswith("probe.") else None)
    cfg = compose("config", overrides=[*job, override]) if job else selfcheck_cfg(tmp_path / "runs", override)
    with pytest.raises(ConfigError) as e:
        runner.run(cfg)
    assert str(e.value) == message
    assert not (tmp_path / "runs").exists()
