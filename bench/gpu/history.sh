#!/usr/bin/env bash
# On the GPU machine, after bench/gpu/setup.sh: is gpt_oss's 16-bit miss (docs/gpu.md, "One
# greedy request, one answer") a process's history reaching later GPU work? Each setting in
# its own process (MLX reads its CUDA-graph switch once): bench/gpu/ring_check.py with
# mlx-lm's answer recomputed after every engine, under MLX's defaults, with CUDA graphs off,
# and with mx.compile off. Then the float32-router cells of the four architectures
# tests/gpu/test_dtypes.py had not run on a GPU. JSON and the log go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SMOE_CACHE=${SMOE_CACHE:-/tmp/smoe-cache}
TRIALS=${TRIALS:-2}
{
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  for setting in ${SETTINGS:-default graphs0 nocompile}; do
    echo "== $setting $(date +%T)"
    case $setting in
    default) env= ; flag= ;;
    graphs0) env=MLX_USE_CUDA_GRAPHS=0 ; flag= ;;
    nocompile) env= ; flag=--no-compile ;;
    esac
    # shellcheck disable=SC2086
    timeout ${EACH_S:-150} env $env python3 bench/gpu/ring_check.py --trials "$TRIALS" $flag \
      --out "$OUT/ring-check-$setting.json" 2>&1 | tail -12
  done
  if [ -n "${DTYPES_K:-}" ]; then
    echo "== dtypes $(date +%T)"
    SMOE_GPU_REPORT=$OUT/gpu-tests.jsonl timeout ${DTYPES_S:-150} python3 -m pytest -q \
      -p no:cacheprovider -m gpu tests/gpu/test_dtypes.py -k "$DTYPES_K" 2>&1 | tail -15
  fi
  echo "== done $(date +%T)"
} 2>&1 | tee "$OUT/history.log"
