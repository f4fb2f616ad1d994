"""Where a result came from: the code's git commit, the package versions, the machine.

Every run directory records this next to the model's weights checksum, so a number can be traced
back to the exact code and environment that produced it. Nothing here fails: a missing git or an
uninstalled package is recorded as None.
"""

from __future__ import annotations

import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

PACKAGES = (
    "kvnotes",
    "torch",
    "transformers",
    "transformer_lens",
    "nnsight",
    "hydra-core",
    "omegaconf",
    "numpy",
    "pandas",
    "pyarrow",
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_state(repo: Path | None = None) -> dict[str, Any]:
    """Commit, branch and dirty flag (any tracked change or untracked, non-ignored file)."""
    root = REPO_ROOT if repo is None else Path(repo)
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain") if commit else None
    return {
        "commit": commit,
        "branch": _git(root, "rev-parse", "--abbrev-ref", "HEAD") if commit else None,
        "dirty": None if status is None else bool(status),
    }


def package_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions (None for a package that is not installed)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict[str, Any]:
    """Python, platform, hostname, and the accelerator when torch sees one."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
    }
    try:
        info["cuda_version"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def collect(repo: Path | None = None) -> dict[str, Any]:
    """Git state, package versions and machine facts in one JSON-serialisable dict."""
    return {"git": git_state(repo), "packages": package_versions(), "machine": machine()}


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and its vector / bf16 flags (/proc/cpuinfo): these ratios move with
    the machine (bf16 is native only with avx512_bf16 or amx_bf16)."""
    out: dict[str, Any] = {"model": None, "flags": []}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and out["model"] is None:
                out["model"] = value.strip()
            elif key.strip() == "flags" and not out["flags"]:
                out["flags"] = [f for f in CPU_FLAGS if f in value.split()]
    except OSError:
        pass
    return out
