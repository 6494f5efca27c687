#!/usr/bin/env bash
# On the GPU machine, after bench/gpu/setup.sh: what MLX's CUDA backend does
# with a staged ring (bench/gpu_probe.py), then the GPU exactness tests (tests/gpu/test_gpu.py).
# Writes probe.json, gpu_tests.jsonl and probe_and_test.log under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
  time python3 bench/gpu_probe.py --rounds ${PROBE_ROUNDS:-200} > "$OUT/probe.json"
  SMOE_GPU_REPORT="$OUT/gpu_tests.jsonl" timeout ${TEST_TIMEOUT:-420} \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py --durations=8
} 2>&1 | tee "$OUT/probe_and_test.log"
