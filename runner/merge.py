"""Join the shards of one sliced run into the run they split.

    python -m runner.merge SHARD_DIR SHARD_DIR [...]

A run too long for one session runs in shards (`experiment.item_slice=[start,stop]`). Each shard is
a finished run at the same job, model and commit, with the same config but for its slice, and the
slices are disjoint and together cover [0, n_items) with no gap. The merge concatenates their records (a unit every shard writes, such as
blend's verify record, is kept once, from the first shard, and must be equal in all), recomputes
the summary from them and writes a new run dir beside the shards whose meta.json names them
(`merged_from`) and carries every shard's attempts. An item may sit in one shard only (a unit that
every shard writes carries no item). It is a run like any other: copy it into the reference set
with `python -m analysis.reference MERGED_DIR`, which applies the usual checks (a shard from a
dirty tree makes the merged run dirty at the top level). A shard whose files changed since it
finished (its recorded digests) is refused; the merged run records digests of its own files
when every shard recorded them, none when one did not (the reference set then asks for --force).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import OmegaConf

from kvnotes.errors import ConfigError
from kvnotes.measure import digests, runfiles
from runner.config import validate
from runner.files import is_link
from runner.jobs import discover
from runner.main import build_summary
from runner.rundir import new_dir, read_json, run_dirty, write_json

FILES = (runfiles.CONFIG, runfiles.META, runfiles.RECORDS, runfiles.SUMMARY)


def _section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The job's own config section (experiment or probe) of a config.yaml mapping."""
    return cfg.get("experiment") or cfg.get("probe") or {}


def _shard(run_dir: Path) -> dict[str, Any]:
    """meta.json of a finished shard; ConfigError says why a dir is not one."""
    missing = [f for f in FILES if not (run_dir / f).is_file()]
    if missing:
        raise ConfigError(f"{run_dir}: not a finished run dir, missing {', '.join(missing)}")
    links = [f for f in FILES if is_link(run_dir / f)]
    if links:
        raise ConfigError(f"{run_dir}: {', '.join(links)} is a symbolic link; a run dir holds its own files")
    meta = read_json(run_dir / runfiles.META)
    if meta.get("status") != "completed":
        raise ConfigError(f"{run_dir}: status {meta.get('status')!r}; only completed shards merge")
    edited = digests.changed(run_dir, meta)
    if edited:
        raise ConfigError(f"{run_dir}: {', '.join(edited)} changed since the shard finished (its sha256 "
                          "differs from the one in meta.json); merge the shards as they were written")
    return meta


def coverage_problem(slices: list[list[int]], n_items: Any) -> str | None:
    """Why disjoint `slices` do not cover [0, n_items) without a gap (n_items not an int: up to
    the last stop), or None."""
    spans = sorted(slices)
    end = n_items if isinstance(n_items, int) and not isinstance(n_items, bool) else spans[-1][1]
    edges = [0, *(x for a, b in spans for x in (a, b)), end]
    gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if a < b]
    if not gaps:
        return None
    where = ", ".join(f"[{a}, {b})" for a, b in gaps)
    return (f"shard slices {spans} leave items {where} of n_items={end} in no shard: merge every "
            "shard of the run (a merged run claims all of its items)")


def check_shards(shards: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[list[int]], str | None]:
    """(metas, configs less slice and results_dir, slices, the first shard's results_dir) of shards
    that make one run."""
    if len(shards) < 2:
        raise ConfigError("a merge needs at least two shard run dirs")
    metas = [_shard(d) for d in shards]
    where = {(d.parent.parent.name, d.parent.name) for d in shards}
    if len(where) != 1:
        raise ConfigError(f"shards of one run share job and model, got {sorted(where)}")
    commits = {str((m.get("git") or {}).get("commit")) for m in metas}
    if len(commits) != 1:
        raise ConfigError(f"shards must run at one commit, got {', '.join(sorted(c[:7] for c in commits))}")
    cfgs = [yaml.safe_load((d / runfiles.CONFIG).read_text()) for d in shards]
    raw = [_section(c).get("item_slice") for c in cfgs]
    slices = [[int(a), int(b)] for a, b in (x for x in raw if isinstance(x, list) and len(x) == 2)]
    if len(slices) != len(raw):
        raise ConfigError(f"every shard needs an item_slice [start, stop), got {raw}")
    spans = sorted(slices)
    if any(b1 > a2 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False)):
        raise ConfigError(f"shard slices overlap: {spans}")
    bare = []
    for c in cfgs:  # what a shard measured: its config less the slice and where it was written
        c = json.loads(json.dumps(c))
        _section(c)["item_slice"] = None
        c.pop("results_dir", None)
        bare.append(c)
    if any(b != bare[0] for b in bare[1:]):
        flat = [pd.json_normalize(b).iloc[0].to_dict() for b in bare]
        diff = sorted({k for f in flat[1:] for k in set(f) | set(flat[0]) if str(f.get(k)) != str(flat[0].get(k))})
        raise ConfigError(f"shards differ beyond item_slice: {', '.join(diff)}")
    gap = coverage_problem(slices, _section(bare[0]).get("n_items"))
    if gap:
        raise ConfigError(gap)
    return metas, bare, slices, cfgs[0].get("results_dir")


def _items(frame: pd.DataFrame) -> set[str]:
    """The items a shard's records hold (`workload:item_id` where records name a workload)."""
    if "item_id" not in frame.columns:
        return set()
    rows = frame[frame["item_id"].notna()]
    work = rows["workload"].astype(str) + ":" if "workload" in rows.columns else ""
    return set(work + rows["item_id"].astype(str))


def read_records(run_dir: Path) -> pd.DataFrame:
    """A shard's records.parquet; ConfigError in one line when it cannot be read (truncated)."""
    try:
        return pd.read_parquet(run_dir / runfiles.RECORDS)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{run_dir / runfiles.RECORDS} cannot be read ({first}); is it truncated?") from None


def merged_records(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, set[str]]:
    """The shards' records as one table, and the units every shard wrote (kept once)."""
    items = [_items(f) for f in frames]
    twice = sorted(x for i, s in enumerate(items) for t in items[i + 1:] for x in s & t)
    if twice:
        raise ConfigError(f"items in more than one shard: {twice[:5]}; each shard holds the items of "
                          "its own slice (was a shard relabelled, or run twice?)")
    units = [set(f["unit"]) for f in frames]
    shared = set.intersection(*units)
    for f in frames[1:]:
        for u in shared:
            a, b = frames[0][frames[0]["unit"] == u], f[f["unit"] == u]
            if not a.reset_index(drop=True).equals(b.reset_index(drop=True)):
                raise ConfigError(f"unit {u!r} differs between shards")
    repeated = sorted(u for i, s in enumerate(units) for t in units[i + 1:] for u in s & t if u not in shared)
    if repeated:
        raise ConfigError(f"units in more than one shard but not all: {repeated[:5]}")
    return pd.concat([frames[0], *(f[~f["unit"].isin(shared)] for f in frames[1:])], ignore_index=True), shared


def merge_runs(shards: list[Path]) -> Path:
    """One run from the shards of a sliced run, written beside them; ConfigError says why not."""
    shards = [Path(d) for d in shards]
    metas, bare, slices, results_dir = check_shards(shards)
    records, shared = merged_records([read_records(d) for d in shards])
    cfg = {**bare[0], "results_dir": results_dir}
    discover()
    summary = build_summary(validate(OmegaConf.create(cfg), check_inputs=False), records)
    summary["finished"] = max(str(read_json(d / runfiles.SUMMARY).get("finished")) for d in shards)
    meta = dict(metas[0])
    meta["attempts"] = [a for m in metas for a in m.get("attempts") or []]
    meta["end_time"] = max(str(m.get("end_time")) for m in metas)
    meta["merged_from"] = [{"run": f"{d.parent.parent.name}/{d.parent.name}/{d.name}", "item_slice": sl,
                            "start_time": m.get("start_time"), "end_time": m.get("end_time")}
                           for d, sl, m in zip(shards, slices, metas, strict=True)]
    meta["merged_shared_units"] = sorted(shared)
    dirty = merged_dirty(metas)
    meta["git"] = {**(meta.get("git") or {}), "dirty": dirty}
    meta["dirty"] = dirty
    meta.pop("digests", None)
    dest = new_dir(shards[0].parent)
    (dest / runfiles.CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))
    records.to_parquet(dest / runfiles.RECORDS, index=False)
    write_json(dest / runfiles.SUMMARY, summary)
    if all(digests.recorded(m) is not None for m in metas):  # else unverified, as its shards are
        meta["digests"] = digests.run_digests(dest, meta)
    write_json(dest / runfiles.META, meta)
    return dest


def merged_dirty(metas: list[dict[str, Any]]) -> bool | None:
    """The merged run's dirty flag: True when any shard or any of its attempts ran from a dirty
    tree, False when every one is recorded clean, None when some tree is unknown."""
    flags = [{"dirty": (m.get("git") or {}).get("dirty")} for m in metas]  # each sums its own attempts
    kept = [a for m in metas for a in m.get("attempts") or [] if isinstance(a, dict) and "dirty" in a]
    return run_dirty([*flags, *kept])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shards", nargs="+", type=Path, help="run dirs of the shards of one sliced run")
    a = p.parse_args(argv)
    try:
        print(merge_runs(a.shards))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
