"""The runner's torch threads (issue #49): OMP_NUM_THREADS is honoured, and meta.json records the
threads the job ran with, not the ones the process had before the runner set them."""

from __future__ import annotations

import pytest
import torch
from tiny_runs import hydra_ready, read, selfcheck_cfg  # noqa: F401

import runner.main as runner
from kvnotes.errors import ConfigError
from runner.config import RunConfig


@pytest.fixture
def two_cores(monkeypatch):
    """A machine of 2 cores, torch at 2 threads before the run (restored after)."""
    monkeypatch.setattr(runner, "_cores", lambda: 2)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_threads_come_from_the_config_then_omp_num_threads_then_the_cores(monkeypatch):
    monkeypatch.setattr(runner, "_cores", lambda: 4)
    assert runner.threads_for(RunConfig(), {}) == (4, "4 cores / 1 parallel job")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": ""}) == (4, "4 cores / 1 parallel job")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS=1")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "6"}) == (6, "OMP_NUM_THREADS=6")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "3,1"}) == (3, "OMP_NUM_THREADS=3")
    assert runner.threads_for(RunConfig(threads=2), {"OMP_NUM_THREADS": "1"}) == (2, "threads= in the config")
    monkeypatch.setattr(runner, "parallel_jobs", lambda: 2)  # joblib sets OMP_NUM_THREADS in its workers
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "1"}) == (1, "OMP_NUM_THREADS=1")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "2"}) == (2, "4 cores / 2 parallel jobs")
    assert runner.threads_for(RunConfig(), {"OMP_NUM_THREADS": "8"}) == (2, "4 cores / 2 parallel jobs")


@pytest.mark.parametrize("bad", ["abc", "0", "-1", "2.5"])
def test_a_bad_omp_num_threads_is_one_line_before_the_run_dir(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("OMP_NUM_THREADS", bad)
    with pytest.raises(ConfigError, match=f"OMP_NUM_THREADS='{bad}' is not a thread count >= 1"):
        runner.run(selfcheck_cfg(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()


def test_the_run_honours_omp_num_threads_and_records_what_it_ran_with(tmp_path, monkeypatch, two_cores):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = []
    real = runner.load

    def load(cfg):
        seen.append(torch.get_num_threads())
        return real(cfg)

    monkeypatch.setattr(runner, "load", load)
    run_dir = runner.run(selfcheck_cfg(tmp_path))
    assert seen == [1], "the job runs with OMP_NUM_THREADS=1, not one thread per core"
    assert "torch threads: 1 (OMP_NUM_THREADS=1)" in (run_dir / "run.log").read_text()
    machine = read(run_dir / "meta.json")["machine"]
    assert (machine["torch_threads"], machine["torch_threads_from"]) == (1, "OMP_NUM_THREADS=1")
    assert torch.get_num_threads() == 2, "restored after the job"


def test_meta_records_the_configs_threads_not_the_ones_before_the_job(tmp_path, monkeypatch, two_cores):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    machine = read(runner.run(selfcheck_cfg(tmp_path, "threads=1")) / "meta.json")["machine"]
    assert (machine["torch_threads"], machine["torch_threads_from"]) == (1, "threads= in the config")


def test_a_jobs_own_threads_setting_is_what_meta_records():
    job = type("Job", (), {"kind": "experiment", "params": type("P", (), {"threads": 1})()})()
    assert runner.ran_with(job, 2, "2 cores / 1 parallel job") == {
        "torch_threads": 1, "torch_threads_from": "experiment.threads=1"}
    job.params.threads = None
    assert runner.ran_with(job, 2, "x") == {"torch_threads": 2, "torch_threads_from": "x"}
