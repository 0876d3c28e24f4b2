#!/usr/bin/env bash
# GPU readiness, on a CUDA machine with the project installed (pip install -e '.[test]'):
#   1. the GPU-marked tests (pytest -m gpu): the batched path on CUDA, bf16, each worker on a GPU
#      of its own through Ray's num_gpus, a target spread over two GPUs (tests needing more GPUs
#      than the machine has are skipped, and say so);
#   2. the throughput run: Qwen2.5-7B / 0.5B shaped models, random weights, bf16 (no download).
# Everything lands in $OUT (default bench-results/gpu). CI never runs this; it skips tests/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench-results/gpu}"
python="${PYTHON:-python}"
mkdir -p "$out"
if ! "$python" -c 'import svip_bench, torch' 2>/dev/null; then
    echo "gpu-check: $python cannot import the project and torch: pip install -e '.[test]' first" >&2
    exit 2
fi
if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: torch sees no CUDA device here (torch $("$python" -c 'import torch; print(torch.__version__)'))" >&2
    exit 2
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
status=0
"$python" -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$out/pytest-gpu.txt" || status=1
"$python" -m svip_bench.gpu_throughput --out "$out" 2>&1 | tee "$out/throughput.txt" || status=1
exit "$status"
