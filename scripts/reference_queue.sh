#!/usr/bin/env bash
# Run the reference jobs of a jobs file one after another (one heavy model job at a time), each in
# a clean git worktree at a named commit, so every run's meta.json records a clean tree.
#
#   bash scripts/reference_queue.sh JOBS_FILE [STATE_DIR]      # STATE_DIR: results/queue
#
# JOBS_FILE, one job per line ('#' starts a comment):
#   checkout SHA            later jobs run in the worktree checked out at SHA (none: this
#                           checkout's HEAD, which must then be committed)
#   TAG COMMAND ...         run COMMAND in the worktree's root; logs to STATE_DIR/TAG.log
# results/reference/jobs.txt lists the jobs of the whole reference set.
# A job that exits 0 is appended to STATE_DIR/done.txt and skipped when the queue is started again;
# a job that fails is logged and the queue goes on. Runs land in STATE_DIR/tree/results/runs/;
# copy a finished one into the reference set with `python -m analysis.reference RUN_DIR`.
# Paths outside the worktree (a venv, the LoCoMo file) are given through $REPO (this checkout) in
# COMMAND: the worktree holds tracked files only, and anything untracked there would mark the runs
# dirty. KVNOTES_VERIFY_WEIGHTS=full is exported: every run re-hashes its weights at load.
set -uo pipefail
jobs=${1:?usage: reference_queue.sh JOBS_FILE [STATE_DIR]}
repo=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(cd "$(dirname "$jobs")" && pwd)/$(basename "$jobs")
state=${2:-$repo/results/queue}
mkdir -p "$state"
tree=$state/tree
touch "$state/done.txt"
export REPO=$repo
# reference runs re-hash every byte of the weights at load (verify_weights=full in the run config;
# 0.36 s for llama on a 2-core EPYC), so a flipped bit is refused rather than recorded as clean
export KVNOTES_VERIFY_WEIGHTS=full
use_commit() {  # the worktree at commit $1, which must be clean there
  if [[ -d "$tree" ]]; then git -C "$tree" checkout -q --detach "$1" || exit 2
  else git -C "$repo" worktree add -q --detach "$tree" "$1" || exit 2; fi
  if [[ -n "$(git -C "$tree" status --porcelain)" ]]; then
    echo "$(date -Is) worktree $tree is not clean; stopping" >&2
    exit 2
  fi
  echo "$(date -Is) checkout $1"
}
if ! grep -q '^checkout ' "$jobs"; then  # no checkout line: this checkout's HEAD
  if [[ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]]; then
    echo "uncommitted changes in $repo: commit them, or name a commit with a 'checkout SHA' line" >&2
    exit 2
  fi
  use_commit "$(git -C "$repo" rev-parse HEAD)"
fi
while read -r tag rest; do
  [[ -z "$tag" || "$tag" == \#* ]] && continue
  if [[ "$tag" == checkout ]]; then
    use_commit "$rest"
    continue
  fi
  grep -qx "$tag" "$state/done.txt" && continue
  [[ -d "$tree" ]] || { echo "no 'checkout SHA' line before job $tag" >&2; exit 2; }
  echo "$(date -Is) start $tag: $rest"
  start=$(date +%s)
  (cd "$tree" && bash -c "$rest") > "$state/$tag.log" 2>&1 </dev/null
  rc=$?
  echo "$(date -Is) end $tag rc=$rc in $(( $(date +%s) - start )) s"
  [[ $rc == 0 ]] && echo "$tag" >> "$state/done.txt"
done < "$jobs"
echo "$(date -Is) queue finished"
