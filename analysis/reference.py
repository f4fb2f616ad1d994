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

The copy is the run as it finished: a run whose config.yaml, records.parquet, summary.json or
meta.json no longer match the sha256 digests the runner recorded at its end (meta.json `digests`;
`python -m experiments.summarize` refreshes the one it rewrites) is refused, --force or not, and
so is a run dir holding a symbolic link where one of its files belongs (the runner refuses them
too). A run that records no digests (finished before runs recorded them) needs --force. So does a
run whose weights were checked by size and header only when it loaded (`verify_weights=header`,
the default: a flipped bit inside tensor data passes that check) unless its weights files are
here to re-hash now and match the sha256 recorded for them. A run already in the reference set
is not copied over: remove the copy first.

The shards of a run too long for a session (`experiment.item_slice`) are joined into one run dir
first (`python -m runner.merge SHARD_DIR ...`), and that run is copied like any other.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvnotes.measure import digests, runfiles
from kvnotes.models.integrity import sha256_file

FILES = (runfiles.CONFIG, runfiles.META, runfiles.RECORDS, runfiles.SUMMARY)
COMMIT = re.compile(r"[0-9a-f]{7,64}")  # a commit id as git prints it: what meta.json may name


def in_history(commit: str, where: Path) -> bool | None:
    """Whether `commit` is HEAD or an ancestor of HEAD in the git checkout holding `where` (its
    nearest existing folder); None when that cannot be told: `where` lies in no checkout, git is
    missing, or a shallow clone lacks the history to say no. A string that is not a commit id
    (hex) is never handed to git: it is in no history."""
    if not COMMIT.fullmatch(str(commit)):
        return False
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
    if not COMMIT.fullmatch(str(git["commit"])):
        return f"meta.json's git commit {str(git['commit'])[:48]!r} is not a commit id (7 to 64 hex digits)"
    attempts = [a for a in meta.get("attempts") or [] if isinstance(a, dict)]
    for i, a in enumerate(attempts, 1):  # a key absent: written before attempts kept the flag
        if "dirty" in a and a["dirty"] is not False:
            what = "ran from a dirty tree" if a["dirty"] else "recorded no git state"
            return (f"attempt {i} of {len(attempts)} {what} (commit {str(a.get('git_commit'))[:7]}); "
                    "a run is clean only if every attempt was")
    if git.get("dirty") is None:
        return (f"meta.json records no git state at commit {str(git['commit'])[:7]} (the tree's status "
                "was not read), so uncommitted changes cannot be ruled out")
    if git.get("dirty") is not False:
        return f"meta.json records a dirty tree at commit {str(git['commit'])[:7]} (uncommitted changes)"
    commits = {str(a["git_commit"]) for a in meta.get("attempts") or []
               if isinstance(a, dict) and a.get("git_commit")}
    if len(commits) > 1:
        return f"resumed across {len(commits)} commits ({', '.join(sorted(c[:7] for c in commits))})"
    if repo is not None and in_history(str(git["commit"]), repo) is False:
        return f"commit {str(git['commit'])[:7]} is not in the history of this checkout"
    return None


@functools.cache
def _rehash(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a weights file, once per file as it is now (several runs share one model)."""
    return sha256_file(Path(path))


def weights_reason(meta: dict[str, Any]) -> str | None:
    """Why a run's weights are not known to be the recorded ones, or None: they were re-hashed
    when it loaded (`weights_verified` sha256), carry no record (a hub or tiny model), or were
    checked by size and header only and re-hash now to the sha256 recorded for each file."""
    raw = meta.get("model")
    prov: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if prov.get("weights_verified") != "size+header":
        return None
    head = "its weights were checked by size and header only when it loaded (verify_weights=header)"
    files, folder = prov.get("weights_files"), prov.get("path")
    if not isinstance(files, dict) or not files or not folder:
        return f"{head} and meta.json names no weights files to re-hash now"
    missing = [n for n in files if not (Path(folder) / n).is_file()]
    if missing:
        return f"{head} and {Path(folder) / missing[0]} is not here to re-hash now"
    bad = []
    for n, sha in files.items():
        st = (Path(folder) / n).stat()
        if _rehash(str(Path(folder) / n), st.st_size, st.st_mtime_ns) != sha:
            bad.append(n)
    if bad:
        return (f"{head}, and {Path(folder) / bad[0]} now hashes to a sha256 other than the one recorded "
                "for it (damaged tensor data)")
    return None


def force_reasons(run_dir: Path, meta: dict[str, Any], repo: Path | None = None) -> list[tuple[str, str]]:
    """(why, what to do) for each reason a completed, unedited run may enter the reference set
    only with --force; empty when it may without."""
    out = []
    dirty = dirty_reason(meta, repo)
    if dirty:
        out.append((dirty, "rerun it from a clean commit"))
    weights = weights_reason(meta)
    if weights:
        out.append((weights, "re-fetch the weights if damaged and rerun it with verify_weights=full, or "
                             "promote it where its weights are"))
    if digests.recorded(meta) is None:
        out.append(("meta.json records no digests of the run's files (it finished before runs recorded "
                    "them), so nothing shows whether they were edited since", "rerun it"))
    return out


def check_run(run_dir: Path, force: bool = False, repo: Path | None = None) -> dict[str, Any]:
    """meta.json of a run fit for the reference set (its commit checked against the checkout
    holding `repo`, when given); ValueError says why one is not."""
    run_dir = Path(run_dir)
    links = [f for f in ("", *FILES) if os.path.islink(run_dir / f)]
    if links:
        what = run_dir / links[0] if links[0] else run_dir
        raise ValueError(f"{what} is a symbolic link; a run dir holds its own files (copy the run "
                         "itself, not a link to it)")
    missing = [f for f in FILES if not (run_dir / f).is_file()]
    if missing:
        raise ValueError(f"{run_dir}: not a finished run dir, missing {', '.join(missing)}")
    meta = json.loads((run_dir / runfiles.META).read_text())
    status = meta.get("status")
    if status != "completed":
        raise ValueError(f"{run_dir}: status {status!r}; only completed runs go into the reference set")
    edited = digests.changed(run_dir, meta)
    if edited:
        raise ValueError(f"{run_dir}: {', '.join(edited)} changed since the run finished (sha256 differs "
                         "from the digest in meta.json); only runs as the runner wrote them are copied")
    reasons = force_reasons(run_dir, meta, repo)
    if reasons and not force:
        why, remedy = reasons[0]
        raise ValueError(f"{run_dir}: {why}; {remedy}, or pass --force (the report then lists it as forced)")
    return meta


def destination(run_dir: Path, to: Path) -> Path:
    """Where a run lands in the reference set: <to>/<job>/<model>/<timestamp>/."""
    run_dir = Path(run_dir)
    return Path(to) / run_dir.parent.parent.name / run_dir.parent.name / run_dir.name


def check_destination(run_dir: Path, to: Path) -> Path:
    """The run's destination, refused when a copy (or a link) is already there."""
    dest = destination(run_dir, to)
    taken = [f for f in ("", *FILES) if os.path.islink(dest / f) or (f and (dest / f).exists())]
    if taken:
        raise ValueError(f"{dest} already holds {taken[0] or 'a link'}: the run is in the reference set; "
                         "remove that copy first to replace it")
    return dest


def copy_run(run_dir: Path, to: Path, force: bool = False) -> Path:
    """Copy one completed run's four files to <to>/<job>/<model>/<timestamp>/; a run that needs
    `force` only with it, and then its copied meta.json says why (`reference.forced`)."""
    run_dir = Path(run_dir)
    meta = check_run(run_dir, force, repo=to)
    dest = check_destination(run_dir, to)
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy2(run_dir / f, dest / f)
    reason = "; ".join(why for why, _ in force_reasons(run_dir, meta, to))
    if reason:
        meta["reference"] = {"forced": True, "reason": reason,
                             "copied": datetime.now(UTC).isoformat(timespec="seconds")}
        (dest / runfiles.META).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories to copy")
    p.add_argument("--to", type=Path, default=Path("results/reference"))
    p.add_argument("--force", action="store_true",
                   help="copy runs made from a dirty tree, without digests or with weights checked by "
                        "header only too (marked as forced with the reason)")
    a = p.parse_args(argv)
    try:
        for run in a.runs:  # every run checked before any is copied
            check_run(run, a.force, repo=a.to)
            check_destination(run, a.to)
        for run in a.runs:
            dest = copy_run(run, a.to, a.force)
            forced = json.loads((dest / runfiles.META).read_text()).get("reference")
            print(dest if not forced else f"{dest} (forced: {forced['reason']})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
