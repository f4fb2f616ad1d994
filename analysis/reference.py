"""Copy finished runs into the committed reference set (config, meta, records, summary only).

    python -m analysis.reference results/runs/edit/qwen-1.5b/2026-12-02_13-19-44 [RUN_DIR ...] [--to results/reference] [--force]

Each run lands at <to>/<job>/<model>/<timestamp>/ with the four files the figures and the report
read; anything else in the run dir (a skill store, logs) stays behind. A run that did not
complete is refused: the reference set holds finished runs only. So is a run whose meta.json
records a dirty tree (uncommitted changes when it ran, or no git state at all), at the top level or
in any of its attempts (a run started from an edited tree and resumed from a clean one is dirty):
its code is not the commit it names. So is a run whose commit is not in the history of the checkout it is copied
into (a commit that never landed cannot be read back). `--force` copies it anyway and marks the
copy's meta.json (`reference.forced`, with the reason), and the report lists every such run. Every
run is checked before any is copied.

    python -m analysis.reference --merge SHARD_DIR SHARD_DIR [...] [--to results/reference]

joins the shards of one run too long for a session (`experiment.item_slice=[start,stop]`, each
shard a finished clean run) into one run: same job, model and commit, the same config but for the
slice, disjoint slices; records concatenated (a unit every shard writes, such as blend's verify
record, is kept once, from the first shard, and must be equal in all), the summary recomputed
from them, meta.json naming the shards (`merged_from`). It lands under the first shard's timestamp.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

FILES = ("config.yaml", "meta.json", "records.parquet", "summary.json")


def in_history(commit: str, where: Path) -> bool | None:
    """Whether `commit` is HEAD or an ancestor of HEAD in the git checkout holding `where` (its
    nearest existing folder); None when that cannot be told: `where` lies in no checkout, git is
    missing, or a shallow clone lacks the history to say no."""
    where = Path(where).resolve()
    while not where.is_dir() and where != where.parent:
        where = where.parent
    try:
        top = subprocess.run(["git", "-C", str(where), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, check=False)
        if top.returncode != 0:
            return None
        r = subprocess.run(["git", "-C", str(where), "merge-base", "--is-ancestor", commit, "HEAD"],
                           capture_output=True, check=False)
        if r.returncode == 0:
            return True
        shallow = subprocess.run(["git", "-C", str(where), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return None
    return False if shallow == "false" else None  # a full clone that lacks it, or where it is no ancestor


def dirty_reason(meta: dict[str, Any], repo: Path | None = None) -> str | None:
    """Why a run's code is not exactly its commit (None: it ran from a clean commit). With `repo`,
    a commit outside the history of the checkout holding `repo` is a reason too."""
    raw = meta.get("git")
    git: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if not git.get("commit"):
        return "meta.json records no git commit"
    attempts = [a for a in meta.get("attempts") or [] if isinstance(a, dict)]
    for i, a in enumerate(attempts, 1):  # a key absent: written before attempts kept the flag
        if "dirty" in a and a["dirty"] is not False:
            what = "ran from a dirty tree" if a["dirty"] else "recorded no git state"
            return (f"attempt {i} of {len(attempts)} {what} (commit {str(a.get('git_commit'))[:7]}); "
                    "a run is clean only if every attempt was")
    if git.get("dirty") is not False:
        return f"meta.json records a dirty tree at commit {str(git['commit'])[:7]} (uncommitted changes)"
    commits = {str(a["git_commit"]) for a in meta.get("attempts") or []
               if isinstance(a, dict) and a.get("git_commit")}
    if len(commits) > 1:
        return f"resumed across {len(commits)} commits ({', '.join(sorted(c[:7] for c in commits))})"
    if repo is not None and in_history(str(git["commit"]), repo) is False:
        return f"commit {str(git['commit'])[:7]} is not in the history of this checkout"
    return None


def check_run(run_dir: Path, force: bool = False, repo: Path | None = None) -> dict[str, Any]:
    """meta.json of a run fit for the reference set (its commit checked against the checkout
    holding `repo`, when given); ValueError says why one is not."""
    run_dir = Path(run_dir)
    missing = [f for f in FILES if not (run_dir / f).is_file()]
    if missing:
        raise ValueError(f"{run_dir}: not a finished run dir, missing {', '.join(missing)}")
    meta = json.loads((run_dir / "meta.json").read_text())
    status = meta.get("status")
    if status != "completed":
        raise ValueError(f"{run_dir}: status {status!r}; only completed runs go into the reference set")
    reason = dirty_reason(meta, repo)
    if reason and not force:
        raise ValueError(f"{run_dir}: {reason}; rerun it from a clean commit, or pass --force "
                         "(the report then lists it as forced)")
    return meta


def copy_run(run_dir: Path, to: Path, force: bool = False) -> Path:
    """Copy one completed run's four files to <to>/<job>/<model>/<timestamp>/; a dirty run only
    with `force`, and then its copied meta.json says so (`reference.forced`)."""
    run_dir = Path(run_dir)
    meta = check_run(run_dir, force, repo=to)
    dest = Path(to) / run_dir.parent.parent.name / run_dir.parent.name / run_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy2(run_dir / f, dest / f)
    reason = dirty_reason(meta, to)
    if reason:
        meta["reference"] = {"forced": True, "reason": reason,
                             "copied": datetime.now(UTC).isoformat(timespec="seconds")}
        (dest / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return dest


def _section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job's own config section (experiment or probe) of a config.yaml mapping."""
    return cfg.get("experiment") or cfg.get("probe") or {}


def merge_runs(shards: list[Path], to: Path) -> Path:
    """One run from the shards of a sliced run (see the module doc); ValueError says why not."""
    import pandas as pd  # deferred: the copy path needs neither pandas nor the runner
    import yaml
    from omegaconf import OmegaConf

    from runner.config import validate
    from runner.jobs import discover
    from runner.main import build_summary

    shards = [Path(d) for d in shards]
    if len(shards) < 2:
        raise ValueError("--merge needs at least two shard run dirs")
    metas = [check_run(d, repo=to) for d in shards]
    where = {(d.parent.parent.name, d.parent.name) for d in shards}
    if len(where) != 1:
        raise ValueError(f"shards of one run share job and model, got {sorted(where)}")
    commits = {str(m["git"]["commit"]) for m in metas}
    if len(commits) != 1:
        raise ValueError(f"shards must run at one commit, got {', '.join(sorted(c[:7] for c in commits))}")
    cfgs = [yaml.safe_load((d / "config.yaml").read_text()) for d in shards]
    raw = [_section(c).get("item_slice") for c in cfgs]
    slices = [x for x in raw if isinstance(x, list) and len(x) == 2]
    if len(slices) != len(raw):
        raise ValueError(f"every shard needs an item_slice [start, stop), got {raw}")
    spans = sorted((int(a), int(b)) for a, b in slices)
    if any(b1 > a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False)):
        raise ValueError(f"shard slices overlap: {spans}")
    bare = []
    for c in cfgs:  # what a shard measured: its config less the slice and where it was written
        c = json.loads(json.dumps(c))
        _section(c)["item_slice"] = None
        c.pop("results_dir", None)
        bare.append(c)
    if any(b != bare[0] for b in bare[1:]):
        flat = [pd.json_normalize(b).iloc[0].to_dict() for b in bare]
        diff = sorted({k for f in flat[1:] for k in set(f) | set(flat[0]) if str(f.get(k)) != str(flat[0].get(k))})
        raise ValueError(f"shards differ beyond item_slice: {', '.join(diff)}")
    frames = [pd.read_parquet(d / "records.parquet") for d in shards]
    units = [set(f["unit"]) for f in frames]
    shared = set.intersection(*units)
    for f in frames[1:]:
        for u in shared:
            a, b = frames[0][frames[0]["unit"] == u], f[f["unit"] == u]
            if not a.reset_index(drop=True).equals(b.reset_index(drop=True)):
                raise ValueError(f"unit {u!r} differs between shards")
    repeated = sorted(u for i, s in enumerate(units) for t in units[i + 1:] for u in s & t if u not in shared)
    if repeated:
        raise ValueError(f"units in more than one shard but not all: {repeated[:5]}")
    records = pd.concat([frames[0], *(f[~f["unit"].isin(shared)] for f in frames[1:])], ignore_index=True)
    first = shards[0]
    dest = Path(to) / first.parent.parent.name / first.parent.name / first.name
    if dest.exists():
        raise ValueError(f"{dest} exists already")
    discover()
    job = validate(OmegaConf.create({**bare[0], "results_dir": cfgs[0].get("results_dir")}), check_inputs=False)
    summary = build_summary(job, records)
    summary["finished"] = max(str(json.loads((d / "summary.json").read_text()).get("finished")) for d in shards)
    meta = dict(metas[0])
    meta["attempts"] = [a for m in metas for a in m.get("attempts") or []]
    meta["end_time"] = max(str(m.get("end_time")) for m in metas)
    meta["merged_from"] = [{"run": f"{d.parent.parent.name}/{d.parent.name}/{d.name}", "item_slice": sl,
                            "start_time": m.get("start_time"), "end_time": m.get("end_time")}
                           for d, sl, m in zip(shards, slices, metas, strict=True)]
    meta["merged_shared_units"] = sorted(shared)
    dest.mkdir(parents=True)
    (dest / "config.yaml").write_text(yaml.safe_dump({**bare[0], "results_dir": cfgs[0].get("results_dir")},
                                                     sort_keys=False))
    (dest / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    records.to_parquet(dest / "records.parquet", index=False)
    (dest / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories to copy")
    p.add_argument("--to", type=Path, default=Path("results/reference"))
    p.add_argument("--force", action="store_true",
                   help="copy runs made from a dirty tree too (marked as forced; the report lists them)")
    p.add_argument("--merge", action="store_true", help="join the shards of one sliced run (item_slice) into one run")
    a = p.parse_args(argv)
    try:
        if a.merge:
            print(merge_runs(a.runs, a.to))
            return 0
        for run in a.runs:  # every run checked before any is copied
            check_run(run, a.force, repo=a.to)
        for run in a.runs:
            dest = copy_run(run, a.to, a.force)
            forced = json.loads((dest / "meta.json").read_text()).get("reference")
            print(dest if not forced else f"{dest} (forced: {forced['reason']})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
