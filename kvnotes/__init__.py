"""kvnotes: read, edit and compose the KV cache of language models.

    import kvnotes as kv
    model = kv.load("llama")
    pair = kv.Pair.from_prompts(model, clean, corrupt, answers=(" Alpha", " Beta"))
    kv.patch_map(model, pair)          # one row per position: token, segment, effect, recovery

docs/api.md lists the top level with a runnable example of each call.
"""

from kvnotes.compose.splice import prefill_block, splice, transplant
from kvnotes.edit.editable import EditableCache, EditError, EditResult
from kvnotes.errors import ConfigError, KvnotesError, UnusablePairWarning
from kvnotes.measure.score import Metric, kl_to_clean, logit_diff, logprob
from kvnotes.models.loading import LoadedModel, load, wrap_model
from kvnotes.pairs import (
    Pair,
    PairError,
    attribution_map,
    knockout,
    linear_probe,
    localize,
    pairs_file,
    patch_map,
    prepare,
    recoveries,
)

__all__ = [
    "ConfigError",
    "EditError",
    "EditResult",
    "EditableCache",
    "KvnotesError",
    "LoadedModel",
    "Metric",
    "Pair",
    "PairError",
    "UnusablePairWarning",
    "attribution_map",
    "kl_to_clean",
    "knockout",
    "linear_probe",
    "load",
    "localize",
    "logit_diff",
    "logprob",
    "pairs_file",
    "patch_map",
    "prefill_block",
    "prepare",
    "recoveries",
    "splice",
    "transplant",
    "wrap_model",
]
