"""Execute the notebooks in place, so a reader opening them sees the results they produce.

    python scripts/execute_notebooks.py                      # all, the science ones on qwen-1.5b
    python scripts/execute_notebooks.py --model llama 01_quickstart

01, 03 and 04 run on `--model` (qwen-1.5b by default: the model that shows the effect, in float32;
04, a user's own prompts, is stored executed on llama: `--model llama 04_your_own_prompts`);
02 reads `results/reference`. Each notebook's metadata records what it ran on (`kvnotes`: model,
commit, dirty flag, date), and tests/cross/test_notebooks.py checks that the stored outputs are whole
(every code cell run in order, no error) and were made on a clean commit. CI executes them again on
llama without writing them back.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: the library beside it
ON_MODEL = {"01_quickstart", "03_edit_and_compose", "04_your_own_prompts"}  # the notebooks that load a model


def execute(path: Path, model: str, timeout: int, git: dict[str, object]) -> None:
    """Run one notebook in place; `git`: the state of the checkout before any notebook was written."""
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    os.environ["KVNOTES_NB_MODEL"] = model
    NotebookClient(book, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    book.metadata["kvnotes"] = {
        "model": model if path.stem in ON_MODEL else None,
        "results": "results/reference" if path.stem == "02_explore_results" else None,
        "commit": git["commit"], "dirty": git["dirty"],
        "executed": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    nbformat.write(book, path)
    print(f"{path.name}: executed on {model if path.stem in ON_MODEL else 'results/reference'}, "
          f"commit {str(git['commit'])[:7]}{' (dirty tree)' if git['dirty'] else ''}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="notebook stems (default: all in notebooks/)")
    p.add_argument("--model", default="qwen-1.5b")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    a = p.parse_args(argv)
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if a.names:
        paths = [q for q in paths if q.stem in a.names]
        if len(paths) != len(a.names):
            print(f"error: unknown notebook in {a.names}", file=sys.stderr)
            return 2
    from kvnotes.measure.provenance import git_state

    git = git_state(ROOT)  # before the first notebook is written back
    for path in paths:
        execute(path, a.model, a.timeout, git)
    return 0


if __name__ == "__main__":
    sys.exit(main())
