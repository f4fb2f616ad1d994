"""The instruments on your own prompts: a `Pair` (two prompts, the field where they differ, a
metric), a prompts file of them, and patching maps, recoveries, attribution checked against exact
patching, knockout against matched random keys, held-out localization and a linear probe, each
returning a tidy DataFrame. Sits above `edit` (it reads patched states through it)."""

from kvnotes.pairs.file import load_pairs, pairs_file, read_pairs_file
from kvnotes.pairs.instruments import (
    attribution_map,
    gate,
    knockout,
    patch_map,
    prepare,
    recoveries,
)
from kvnotes.pairs.localize import linear_probe, localize
from kvnotes.pairs.pair import Pair, PairError

__all__ = [
    "Pair",
    "PairError",
    "attribution_map",
    "gate",
    "knockout",
    "linear_probe",
    "load_pairs",
    "localize",
    "pairs_file",
    "patch_map",
    "prepare",
    "read_pairs_file",
    "recoveries",
]
