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

The shards of a run too long for a session (`experiment.item_slice`) are joined into one run dir
first (`python -m runner.merge SHARD_DIR ...`), and that run is copied like any other.
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories to copy")
    p.add_argument("--to", type=Path, default=Path("results/reference"))
    p.add_argument("--force", action="store_true",
                   help="copy runs made from a dirty tree too (marked as forced; the report lists them)")
    a = p.parse_args(argv)
    try:
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
