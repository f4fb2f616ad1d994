"""Every run under a results folder as one tidy DataFrame: one row per record, with run columns.

A run is a folder holding records.parquet (results/runs/<job>/<model>/<timestamp>/, or a copy
under results/reference/). Its config.yaml and meta.json give the columns that say where a
record came from: job (probe or experiment name), job_kind, model, task, seed, commit, margin,
run_id. Folders without config or meta (a bare copy) fall back on the path. Runs that did not
complete are left out unless asked for; `latest` keeps the newest run per (job, model, task,
seed, run_variant), so a rerun replaces an older one instead of being pooled with it; run_variant
keeps a CoT-only edit run (`experiment.cot_only=true`, strategies `*+cot`) beside the plain one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from kvnotes.measure import runfiles

log = logging.getLogger(__name__)

RUN_COLUMNS = ("run_id", "job", "job_kind", "model", "task", "task_n_items", "seed", "commit",
               "dirty", "forced", "status", "started", "run_variant", "margin", "model_margin", "dtype", "device", "weights", "run_path")
KEY = ("job", "model", "task", "seed", "run_variant")  # runs that answer the same question
PROBES = frozenset({"patching", "suffix", "linear", "knockout"})
NO_TASK_JOBS = frozenset({"selfcheck", "compose", "compose_scaling", "agent", "blend"})  # ignore cfg.task
# a user's prompts file (task=pairs): its runs answer the user's question, not the paper's; the
# claims, sections and figures leave them out unless asked (`user=True`), the pairs section reads them
USER_TASKS = frozenset({"pairs"})


def _suites(df: pd.DataFrame, user: bool) -> pd.DataFrame:
    if "task" not in df:
        return df
    keep = df["task"].isin(USER_TASKS)
    return df[keep] if user else df[~keep]
MARGIN_JOBS = frozenset({"patching", "suffix", "knockout", "edit", "ksweep", "wording", "validate_tasks",
                         "distance", "order"})


def find_runs(results: str | Path) -> list[Path]:
    """Run folders below `results`: every folder with a records.parquet, sorted."""
    root = Path(results)
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.rglob(runfiles.RECORDS) if not p.name.startswith("."))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) if path.exists() else None
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path.exists() else None
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _margin(cfg: dict[str, Any]) -> float | None:
    """The margin the run judged items by: the job's own, else the model config's."""
    for section in ("probe", "experiment"):
        sec = cfg.get(section)
        if isinstance(sec, dict) and sec.get("margin") is not None:
            return float(sec["margin"])
    model = cfg.get("model")
    if isinstance(model, dict) and model.get("margin") is not None:
        return float(model["margin"])
    return None


def _variant(job: str | None, cfg: dict[str, Any]) -> str:
    """What sets a run apart from others of its job, model, task and seed: "cot" for a CoT-only edit
    run; "decisions" for a knockout run without read heads or the after_notes variant (BESIDE); a
    blend run's workloads ("skills+memory+locomo"), so a run of one workload does not replace
    a run of others (readers keep the newest run per model and workload: `newest_per_workload`)."""
    exp = cfg.get("experiment") if isinstance(cfg.get("experiment"), dict) else {}
    probe = cfg.get("probe") if isinstance(cfg.get("probe"), dict) else {}
    if job == "knockout" and (probe.get("read_heads") is False or probe.get("variants") == ["decision"]):
        return "decisions"  # a decision-variant rerun (e.g. for score_cf) beside, not over, the full design
    if job == "blend" and isinstance(exp.get("workloads"), list):
        return "+".join(str(w) for w in exp["workloads"])
    return "cot" if job == "edit" and exp.get("cot_only") else ""


def run_info(run_dir: str | Path, results: str | Path | None = None) -> dict[str, Any]:
    """The run columns of one run folder (config.yaml and meta.json; the path where they lack)."""
    path = Path(run_dir)
    cfg, meta = _read_yaml(path / runfiles.CONFIG), _read_json(path / runfiles.META)
    summary = _read_json(path / runfiles.SUMMARY)
    parts = path.parts
    job = meta.get("name") or summary.get("name") or (parts[-3] if len(parts) >= 3 else None)
    for section in ("probe", "experiment"):
        sec = cfg.get(section)
        if isinstance(sec, dict) and sec.get("name"):
            job = sec["name"]
    kind = meta.get("kind") or summary.get("kind") or ("probe" if job in PROBES else "experiment")
    model_cfg = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    model = meta.get("model_name") or summary.get("model") or model_cfg.get("name") or (
        parts[-2] if len(parts) >= 2 else None)
    task = cfg.get("task") if isinstance(cfg.get("task"), dict) else {}
    git = meta.get("git") if isinstance(meta.get("git"), dict) else {}
    prov = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    if results is not None:
        try:
            run_id = path.resolve().relative_to(Path(results).resolve()).as_posix()
        except ValueError:
            run_id = path.as_posix()
    else:
        run_id = path.as_posix()
    return {
        "run_id": run_id,
        "job": job,
        "job_kind": kind,
        "model": model,
        "task": None if job in NO_TASK_JOBS else task.get("name"),
        "task_n_items": None if job in NO_TASK_JOBS else task.get("n_items"),
        "seed": meta.get("seed", cfg.get("seed")),
        "commit": git.get("commit"),
        "dirty": git.get("dirty"),
        "forced": bool((meta.get("reference") or {}).get("forced")) if isinstance(meta.get("reference"), dict) else False,
        "status": meta.get("status", "completed" if summary else "unknown"),
        "started": meta.get("start_time") or path.name,
        "run_variant": _variant(job, cfg),
        "margin": _margin(cfg) if job in MARGIN_JOBS else None,
        "model_margin": model_cfg.get("margin") if job in MARGIN_JOBS else None,
        "dtype": meta.get("dtype"),
        "device": meta.get("device"),
        "weights": prov.get("hub_id") or prov.get("weights_sha256"),
        "run_path": str(path),
    }


def runs_table(results: str | Path, include_incomplete: bool = False) -> pd.DataFrame:
    """One row per run folder with its run columns (completed runs only unless asked)."""
    rows = [run_info(p, results) for p in find_runs(results)]
    table = pd.DataFrame(rows, columns=list(RUN_COLUMNS))
    if not include_incomplete and len(table):
        bad = table[table["status"] != "completed"]
        for r in bad.itertuples():
            log.info("left out %s: status %s", r.run_id, r.status)
        table = table[table["status"] == "completed"]
    return table.reset_index(drop=True)


def latest(runs: pd.DataFrame, key: Sequence[str] = KEY) -> pd.DataFrame:
    """The run each `key` group is read from: the finest dtype first (a float32 run before a
    bfloat16 one, which is kept beside it to show what the dtype changes, not to replace it:
    analysis/dtype_section.py), then the newest (by start time, then folder name)."""
    if runs.empty:
        return runs
    dtype = runs["dtype"].astype(str) if "dtype" in runs else pd.Series("", index=runs.index)
    order = runs.assign(_p=dtype.isin(["float32", "float64"]).astype(int),
                        _s=runs["started"].astype(str), _r=runs["run_id"].astype(str))
    order = order.sort_values(["_p", "_s", "_r"])
    keep = order.groupby(list(key), dropna=False, sort=False).tail(1)
    return keep.drop(columns=["_p", "_s", "_r"]).sort_values(list(key)).reset_index(drop=True)


def read_records(run: pd.Series | dict[str, Any]) -> pd.DataFrame:
    """The records of one run with its run columns in front. A record column that shares a run
    column's name is kept as `<name>_record`."""
    rec = pd.read_parquet(Path(run["run_path"]) / runfiles.RECORDS)
    clash = {c: f"{c}_record" for c in rec.columns if c in RUN_COLUMNS}
    rec = rec.rename(columns=clash)
    front = pd.DataFrame({c: [run[c]] * len(rec) for c in RUN_COLUMNS}, index=rec.index)
    return pd.concat([front, rec], axis=1)


def load(results: str | Path = "results/reference", *, jobs: Iterable[str] | None = None,
         newest_only: bool = True, include_incomplete: bool = False) -> pd.DataFrame:
    """All records under `results` as one tidy frame (run columns + record columns).

    `jobs` keeps some probes/experiments; `newest_only` keeps the newest run per
    (job, model, task, seed). Columns a record type does not have are NaN.
    """
    runs = runs_table(results, include_incomplete)
    if jobs is not None:
        runs = runs[runs["job"].isin(list(jobs))]
    if newest_only:
        runs = latest(runs)
    frames = [read_records(r) for _, r in runs.iterrows()]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=list(RUN_COLUMNS))
    # .copy() consolidates the blocks a concat of differently-columned frames leaves (pandas warns on
    # every later column insert into a fragmented frame)
    return pd.concat(frames, ignore_index=True, sort=False).copy()


def job_params(frame: pd.DataFrame, run_id: str) -> dict[str, Any]:
    """The probe or experiment section of a run's config.yaml (empty when there is none)."""
    rows = frame.loc[frame["run_id"] == run_id, "run_path"]
    if rows.empty:
        return {}
    cfg = _read_yaml(Path(str(rows.iloc[0])) / runfiles.CONFIG)
    for section in ("probe", "experiment"):
        if isinstance(cfg.get(section), dict):
            return dict(cfg[section])
    return {}


BESIDE = {"knockout": "decisions"}  # job -> run_variant of reruns kept beside its full runs, never pooled with them


def select(frame: pd.DataFrame, job: str, tasks: Sequence[str] | None = None) -> pd.DataFrame:
    """Records of one job, restricted to the first of `tasks` that has records per model; a rerun of
    part of a job's design (BESIDE: a decision-variant knockout) is left out, read from its summary."""
    df = _suites(frame[frame["job"] == job] if "job" in frame else frame.iloc[:0], user=False)
    if job in BESIDE and "run_variant" in df:
        df = df[df["run_variant"].fillna("") != BESIDE[job]]
    if tasks is None or df.empty:
        return df
    keep = []
    for _, g in df.groupby("model", sort=True):
        for t in tasks:
            if (g["task"] == t).any():
                keep.append(g[g["task"] == t])
                break
    return pd.concat(keep) if keep else df.iloc[:0]


def summaries(frame: pd.DataFrame, job: str, user: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """(model, run_id, summary.json) of every `job` run among the frame's runs, oldest first; runs
    whose summary.json is missing or unreadable are skipped. `user`: the runs on a user's prompts
    file (USER_TASKS) instead of the task suites'."""
    if frame.empty or "job" not in frame:
        return []
    runs = _suites(frame[frame["job"] == job], user).drop_duplicates("run_id").sort_values("run_id")
    out = []
    for r in runs.itertuples():
        path = Path(str(getattr(r, "run_path", ""))) / runfiles.SUMMARY
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.append((str(r.model), str(r.run_id), summary))
    return out


def newest_summaries(frame: pd.DataFrame, job: str, user: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """(model, run_id, summary.json) of the newest `job` run per model among the frame's runs."""
    out = {model: (model, run_id, s) for model, run_id, s in summaries(frame, job, user)}  # newest wins
    return list(out.values())


def newest_per_workload(frame: pd.DataFrame) -> pd.DataFrame:
    """Blend records: per model and workload, only those of the newest run that has that workload
    (a long run may be split into one run per workload; a later run of a workload replaces it)."""
    if frame.empty or "workload" not in frame:
        return frame
    newest = frame.groupby(["model", "workload"], dropna=False)["run_id"].transform("max")
    return frame[frame["run_id"] == newest]
