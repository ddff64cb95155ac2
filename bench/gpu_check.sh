#!/usr/bin/env bash
# The GPU checks of the engine-speed work as one command for a CUDA machine (fits a 10-minute slot on an H200):
# install this checkout into the machine's Python without dependencies (torch, triton, transformers,
# tokenizers, pydantic, safetensors are expected there), run the kernel checks and timings
# (bench/gpu_kernels.py, rotary included), then the engine smoke (bench/gpu_engine.py: greedy CUDA float32
# == CPU float32 with and without CUDA graphs, bfloat16 logits within tolerance, tokens/s graphs on vs off).
# JSON lands in bench/results/; with a folder argument it is also copied there.
#
#   bash bench/gpu_check.sh [COPY_RESULTS_TO]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
status=0
timeout 300 python3 bench/gpu_kernels.py || status=1
timeout 270 python3 bench/gpu_engine.py || status=1
if [[ $# -ge 1 ]]; then
  mkdir -p "$1" && cp bench/results/gpu_kernels.json bench/results/gpu_engine.json "$1"/ 2>/dev/null
fi
exit $status
