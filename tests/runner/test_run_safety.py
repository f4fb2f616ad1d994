"""What a run may not do to another run's data, and the one-line errors a user sees instead.

Two runs of one command share a run directory only through its lock: the second is refused
with the holder's pid and host, a completed run is never rewritten, and a stray temporary file
in parts/ never fails a completed run. Bad configs stop before any run directory exists; every
refusal reaches the command line as one `error:` line. Each run dir records how it was started.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose
from tiny_runs import (  # noqa: F401
    ROOT,
    SMALL,
    TINY,
    hydra_ready,
    interrupted_run,
    read,
    selfcheck_cfg,
)

import runner.main as runner
from runner import rundir as output
from runner.config import ConfigError, validate
from runner.context import suite_checks
from runner.rundir import RecordWriter, RunDirError, RunLock


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "experiments.run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


# --- the lock -----------------------------------------------------------------------------------


def test_a_run_dir_held_by_another_process_is_refused_naming_the_holder(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path, monkeypatch)
    before = (path / "meta.json").read_text()
    holder = RunLock(path)
    assert holder.acquire()
    try:
        with pytest.raises(RunDirError, match=f"is in use by pid {os.getpid()} on {socket.gethostname()}"):
            runner.run(selfcheck_cfg(tmp_path))
    finally:
        holder.release()
    assert (path / "meta.json").read_text() == before  # untouched while held
    assert runner.run(selfcheck_cfg(tmp_path)) == path  # free again: it resumes


def test_a_run_that_completed_meanwhile_is_never_rewritten(tmp_path, monkeypatch):
    """Both processes found the same unfinished dir; the first completed it before the second
    took the lock. The second must leave it alone and start its own directory."""
    path = interrupted_run(tmp_path, monkeypatch)
    meta = read(path / "meta.json") | {"status": "completed"}
    (path / "meta.json").write_text(json.dumps(meta))
    done = (path / "meta.json").read_text()
    seen = []

    def stale_search(parent, chash):  # what the second process saw before the first finished
        seen.append(1)
        return path if len(seen) == 1 else None

    monkeypatch.setattr(output, "find_unfinished", stale_search)
    other = runner.run(selfcheck_cfg(tmp_path))
    assert other != path and read(other / "meta.json")["status"] == "completed"
    assert (path / "meta.json").read_text() == done and (path / "parts").is_dir()


def test_cli_refuses_a_run_dir_another_process_holds(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path / "runs", monkeypatch)
    code = ("import sys, time; from pathlib import Path; from runner.rundir import RunLock; "
            "lock = RunLock(Path(sys.argv[1])); assert lock.acquire(); print('held', flush=True); "
            "time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        proc = cli(tmp_path, "+experiment=selfcheck", f"results_dir={tmp_path / 'runs'}", *TINY, *SMALL)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == (f"error: {path} is in use by pid {holder.pid} on {socket.gethostname()} "
                         f"(since {read(path / '.holder.json')['since']}): wait for it to finish, "
                         "or pass resume=false to start a separate run")
    assert read(path / "meta.json")["status"] == "interrupted"


# --- cleanup ------------------------------------------------------------------------------------


def test_a_leftover_tmp_in_parts_does_not_fail_a_completed_run(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path, monkeypatch)
    stray = path / "parts" / ".block-001.parquet.tmp"  # a write killed before its rename
    stray.write_bytes(b"partial")
    assert runner.run(selfcheck_cfg(tmp_path)) == path
    assert read(path / "meta.json")["status"] == "completed"
    assert not (path / "parts").exists()


def test_cleanup_never_raises(tmp_path, caplog):
    w = RecordWriter(tmp_path)
    w.write("a", [{"x": 1}])
    (w.parts / "notes.txt").write_text("a file a user left here")
    w.finalize()
    w.cleanup()  # the unknown file stays, the run does not fail
    assert (w.parts / "notes.txt").exists() and not list(w.parts.glob("*.parquet"))
    assert "left" in caplog.text


# --- nothing is written for a bad config ----------------------------------------------------------


@pytest.mark.parametrize("override", ["task.n_items=-3", "+task.nitems=4", "task.length=10000000",
                                      "task.name=nope"])
def test_bad_task_leaves_no_run_dir(tmp_path, override):
    with pytest.raises(ConfigError):
        runner.run(selfcheck_cfg(tmp_path / "runs", override))
    assert not (tmp_path / "runs").exists()


def test_task_length_below_the_prompt_skeleton_is_a_config_error(tmp_path):
    cfg = compose("config", overrides=["+experiment=validate_tasks", f"results_dir={tmp_path}", *TINY,
                                       "task.n_items=1", "task.length=50", "progress=false"])
    with pytest.raises(ConfigError, match="task 'gated': length 50 is below the .* tokens item 0 needs"):
        runner.run(cfg)


@pytest.fixture
def no_load(monkeypatch):
    """runner.load fails the test: what is refused must be refused before the model loads."""
    monkeypatch.setattr(runner, "load", lambda cfg: pytest.fail("the model loaded"))


def test_a_short_task_length_is_refused_before_the_model_loads_or_a_run_dir(tmp_path, no_load):
    """Issue #49: the refusal came after the load and left a failed run dir behind."""
    from kvnotes import tasks
    from kvnotes.models.tiny import tiny_tokenizer

    need, item = tasks.required_length("gated", tiny_tokenizer(), chat=False, n_items=4, seed=0)
    cfg = compose("config", overrides=["+experiment=validate_tasks", f"results_dir={tmp_path / 'runs'}",
                                       *TINY, "task.n_items=4", f"task.length={need - 1}"])
    with pytest.raises(ConfigError, match=rf"^task 'gated': length {need - 1} is below the {need} tokens "
                                          rf"item {item} needs without filler; use task.length >= {need}$"):
        runner.run(cfg)
    assert not (tmp_path / "runs").exists()
    probe = compose("config", overrides=["+probe=patching", f"results_dir={tmp_path / 'runs'}", *TINY,
                                         "task=skills", "task.n_items=2", "task.length=300"])
    with pytest.raises(ConfigError, match=r"^task 'skills': length 300 is below the \d+ tokens item"):
        runner.run(probe)  # a probe always builds the task's items
    assert not (tmp_path / "runs").exists()


def test_a_packaged_models_tokenizer_checks_the_length_without_its_weights(tmp_path, no_load):
    from kvnotes.models import WeightsError, load_tokenizer

    try:
        load_tokenizer("llama")
    except WeightsError as e:
        pytest.skip(f"llama's tokenizer is not fetched: {e}")
    cfg = compose("config", overrides=["+experiment=validate_tasks", f"results_dir={tmp_path / 'runs'}",
                                       "model=llama", "task.n_items=2", "task.length=100"])
    with pytest.raises(ConfigError, match=r"^task 'gated': length 100 is below the 2\d\d tokens item"):
        runner.run(cfg)
    assert not (tmp_path / "runs").exists()


def test_blends_short_skills_length_is_refused_before_the_model_loads(tmp_path, no_load):
    cfg = compose("config", overrides=["+experiment=blend", f"results_dir={tmp_path / 'runs'}", *TINY,
                                       "experiment.workloads=[skills]", "experiment.n_items=2",
                                       "experiment.skills_length=420"])
    with pytest.raises(ConfigError, match=r"^experiment.skills_length \(suite 'skills'\): length 420 is "
                                          r"below the \d+ tokens item \d needs without filler; use "
                                          r"experiment.skills_length >= \d+$"):
        runner.run(cfg)
    assert not (tmp_path / "runs").exists()
    blended = compose("config", overrides=["+experiment=blend", *TINY, "experiment.workloads=[memory]",
                                           "experiment.skills_length=420"])
    assert suite_checks(validate(blended)) == [], "no skills workload: nothing to check"


def test_a_job_that_does_not_build_the_task_is_not_held_to_its_length(tmp_path):
    run_dir = runner.run(selfcheck_cfg(tmp_path, "task.length=50", "threads=1"))  # selfcheck reads no task
    assert read(run_dir / "meta.json")["status"] == "completed"


def test_experiments_that_build_the_task_say_so():
    """READS_TASK on every experiment whose source builds the task group's items."""
    from runner import jobs

    for name in jobs.names("experiment"):
        entry = jobs.get("experiment", name)
        source = Path(sys.modules[entry.module].__file__).read_text()
        builds = "ctx.items()" in source or "experiments.shared.edits import" in source
        assert entry.reads_task == builds, f"{entry.module}: READS_TASK = {builds} is missing or wrong"
    assert all(jobs.get("probe", n).reads_task for n in jobs.names("probe"))


def test_positions_are_checked_after_load_when_the_config_was_not_on_disk(monkeypatch):
    from kvnotes.models import budget
    from runner.config import validate

    monkeypatch.setattr(budget, "model_shape", lambda *a: None)  # not fetched at validation time
    cfg = validate(compose("config", overrides=["+experiment=validate_tasks", "model=llama",
                                                "task.length=9000"])).cfg
    loaded = SimpleNamespace(hf=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192)))
    with pytest.raises(ConfigError, match="task.length=9000 exceeds the 8192 positions of model llama"):
        runner.check_loaded_positions(cfg, loaded)


def test_results_dir_that_cannot_be_created_is_one_error(tmp_path, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(RunDirError, match="cannot create the run directory under .*: Permission denied"):
        runner.run(selfcheck_cfg(tmp_path / "runs"))


# --- what a user sees on the command line -------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["task.n_items=abc"], "error: Error merging override task.n_items=abc: task.n_items: Value 'abc' "
                               "of type 'str' could not be converted to Integer"),
        (["+task.nitems=4"], "error: task.nitems: Key 'nitems' not in 'GatedTask'"),
        (["task.n_items=-3"], "error: task.n_items must be >= 1, got -3"),
        (["results_dir=results.txt"], "error: results_dir='results.txt' is a file, not a directory"),
        (["+experiment=serving", "experiment.python=.venv-missing/bin/python", "experiment.length=800",
          "experiment.max_model_len=1024"],
         "error: experiment.python='.venv-missing/bin/python': {root}/.venv-missing/bin/python not found; "
         "create the server env with `bash scripts/serving_env.sh`, or give experiment.url"),
    ],
)
def test_cli_bad_input_is_one_error_line(tmp_path, args, line):
    (tmp_path / "results.txt").write_text("")
    job = [] if any(a.startswith("+experiment") for a in args) else ["+experiment=selfcheck"]
    proc = cli(tmp_path, *job, *TINY, "progress=false", *args)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == line.format(root=ROOT)
    assert [p.name for p in tmp_path.iterdir()] == ["results.txt"] or "serving" in args[0]


def test_cli_unknown_group_option_is_one_line_listing_the_options(tmp_path):
    proc = cli(tmp_path, "+experiment=selfcheck", "task=nope")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: In 'config': Could not find 'task/nope'; Available options in 'task': "
                           "gated, gated-control")
    assert "search path" not in line


def test_help_lists_the_groups_a_user_picks_not_the_schemas(tmp_path):
    proc = cli(tmp_path, "--help")
    assert proc.returncode == 0
    groups = proc.stdout.split("== Config ==")[0]
    assert "schema" not in groups
    for group in ("experiment: ", "model: ", "probe: ", "task: "):
        assert group in groups
    assert "selfcheck" in groups and "gated-polarity" in groups and "qwen-1.5b" in groups


# --- what a run leaves behind -------------------------------------------------------------------


def test_run_dir_records_command_overrides_and_log(tmp_path):
    args = ["+experiment=selfcheck", *TINY, *SMALL, "results_dir=runs"]
    proc = cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs" / "selfcheck" / "tiny-llama").iterdir()
    command = (run_dir / "command.txt").read_text().splitlines()
    assert command[0].startswith("# attempt 1, ") and command[0].endswith(f"cwd {tmp_path}")
    assert command[1] == shlex.join(["python", "-m", "experiments.run", *args])
    assert yaml.safe_load((run_dir / "overrides.yaml").read_text()) == args
    log = (run_dir / "run.log").read_text()
    assert "new run dir" in log and "completed" in log and "INFO" in log
    attempt = read(run_dir / "meta.json")["attempts"][0]
    assert attempt["overrides"] == args and attempt["command"] == command[1]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["margin"] == 1.0  # resolved, saved


def test_command_line_reads_as_typed():
    assert runner.command_line(["/repo/experiments/run.py", "+probe=patching", "task.domains=[a,b]"]) == \
        "python -m experiments.run +probe=patching 'task.domains=[a,b]'"
    assert runner.command_line(["kvnotes run", "+experiment=selfcheck"]) == "kvnotes run +experiment=selfcheck"
