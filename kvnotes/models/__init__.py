"""Models kvnotes can load by name, their offline weights and their family adapters."""

from kvnotes.models.adapters import FAMILIES, FamilyAdapter, adapter_for
from kvnotes.models.devices import resolve_device, resolve_dtype
from kvnotes.models.loading import (
    LoadedModel,
    load,
    load_model,
    load_tokenizer,
    wrap_model,
)
from kvnotes.models.registry import ModelSpec, UnknownModelError, get_spec, model_names, register
from kvnotes.models.weights import prepare, prepare_tokenizer
from kvnotes.models.wheels import WeightsError, cache_dir, fetch

__all__ = [
    "FAMILIES",
    "FamilyAdapter",
    "LoadedModel",
    "ModelSpec",
    "UnknownModelError",
    "WeightsError",
    "adapter_for",
    "cache_dir",
    "fetch",
    "get_spec",
    "load",
    "load_model",
    "load_tokenizer",
    "model_names",
    "prepare",
    "prepare_tokenizer",
    "register",
    "resolve_device",
    "resolve_dtype",
    "wrap_model",
]
