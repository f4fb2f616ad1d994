"""The README's performance summary, regenerated from committed engine benchmark JSONs.

Every JSON under results/reference/benchmarks whose rows carry the in-place keys (issue #35:
`inplace_share_of_limit`, `multiblock_k0_share_of_limit`, the tier speedups) gives: time to first token of a stored block attended in place and of eight blocks at
K = 0, each as a share of the limit (the question alone over a cache already in place), and the
one block's speedup over a full prefill from host memory and from disk with a cold page cache.
One row per model, dtype, machine and commit (runs of one commit on one machine join, their
lengths' values in order); ratios come from one run each, a row names its machine and its JSON
files, and rows of different machines do not compare.

    python -m benchmarks.readme_table            # print the table
    python -m benchmarks.readme_table --write    # replace it in README.md between its markers
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "results" / "reference" / "benchmarks"
BEGIN, END = "<!-- performance table: python -m benchmarks.readme_table --write -->", "<!-- end of performance table -->"
KEYS = ("inplace_share_of_limit", "multiblock_k0_share_of_limit")


def _machine(row: dict) -> str:
    cpu = row.get("cpu") or {}
    if row.get("device", "cpu") != "cpu":
        return str(row.get("gpu") or row.get("device"))
    name = str(cpu.get("model") or "CPU").replace("(R)", "").replace(" Processor", "")
    return name + (" (AMX)" if "amx_bf16" in (cpu.get("flags") or []) else "")


def _f(v: object, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and v == v else "-"


def rows(bench: Path = BENCH) -> list[str]:
    """One row per model, dtype, machine and commit (the runs of one commit on one machine, e.g. a
    length per run, join into one row), its lengths' values in order."""
    groups: dict[tuple[str, ...], list[tuple[dict, str]]] = {}
    for path in sorted(bench.glob("*.json")):
        data = json.loads(path.read_text())
        for r in (data if isinstance(data, list) else []):
            if isinstance(r, dict) and r.get(KEYS[0]) is not None:
                key = (str(r.get("model")), str(r.get("dtype")), _machine(r), str(r.get("commit")))
                groups.setdefault(key, []).append((r, path.name))
    out = []
    for members in groups.values():
        rs = [r for r, _ in sorted(members, key=lambda m: m[0].get("length", 0))]
        def cells(key: str, fmt: str) -> str:
            return " / ".join(_f(r.get(key), fmt) for r in rs)  # noqa: B023 (called in this iteration)
        lengths = " / ".join(f"{r.get('length', 0) / 1000:g}k" for r in rs)
        reps = {r.get("reps") for r in rs}
        reps_cell = str(reps.pop()) if len(reps) == 1 else cells("reps", "d")
        files = ", ".join(f"`{n}`" for n in dict.fromkeys(n for _, n in members))
        out.append(f"| {rs[0].get('model')} {rs[0].get('dtype')} | {_machine(rs[0])} | {lengths} | "
                   f"{cells(KEYS[0], '.2f')} | {cells(KEYS[1], '.2f')} | {cells('tier_host_speedup', '.1f')} | "
                   f"{cells('tier_disk_speedup', '.1f')} | {reps_cell} | {files} |")
    return out


def table(bench: Path = BENCH) -> str:
    head = ["| model | machine | tokens | one block in place / limit | eight blocks, K = 0, in place / limit "
            "| speedup over full prefill, host tier | the same, cold disk | reps | JSON |", "|---" * 9 + "|"]
    return "\n".join([*head, *rows(bench)])


def replace(readme: str, new: str) -> str:
    """README text with the block between BEGIN and END replaced by `new`."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README has no performance table markers ({BEGIN!r} ... {END!r})")
    a, b = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:a] + "\n" + new + "\n" + readme[b:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help="replace the table in README.md")
    a = p.parse_args(argv)
    text = table()
    if a.write:
        path = ROOT / "README.md"
        path.write_text(replace(path.read_text(), text))
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
