"""One adapter per model family; `adapter_for` picks it from a family name or HF model_type."""

from __future__ import annotations

from kvnotes.models.adapters.base import FamilyAdapter
from kvnotes.models.adapters.gemma2 import Gemma2Adapter
from kvnotes.models.adapters.gemma3 import Gemma3Adapter
from kvnotes.models.adapters.llama import LlamaAdapter
from kvnotes.models.adapters.mistral import MistralAdapter
from kvnotes.models.adapters.qwen2 import Qwen2Adapter
from kvnotes.models.adapters.qwen3 import Qwen3Adapter

_ADAPTERS: dict[str, type[FamilyAdapter]] = {}
for _cls in (LlamaAdapter, Qwen2Adapter, Qwen3Adapter, MistralAdapter, Gemma2Adapter, Gemma3Adapter):
    if _cls.family in _ADAPTERS:
        raise ValueError(f"duplicate adapter for family {_cls.family!r}")
    _ADAPTERS[_cls.family] = _cls

FAMILIES: tuple[str, ...] = tuple(_ADAPTERS)


def adapter_for(family_or_model_type: str) -> FamilyAdapter:
    for cls in _ADAPTERS.values():
        if family_or_model_type == cls.family or family_or_model_type in cls.model_types:
            return cls()
    raise KeyError(
        f"no adapter for {family_or_model_type!r}; supported families: {', '.join(FAMILIES)}"
    )


__all__ = ["FAMILIES", "FamilyAdapter", "adapter_for"]
