#!/usr/bin/env bash
# On the GPU machine, after bench/gpu/setup.sh: one greedy answer per request whatever path
# the engine switches between (tests/gpu/test_paths.py: pre-warm and pinning mid-request,
# batches changing, prefix reuse, smaller rings, a neighbour holding and using the GPU), and
# float32 routers kept float32 (tests/gpu/test_dtypes.py), after the versions check
# (tests/gpu/test_versions.py). Each phase is bounded so the whole stays inside one call.
# Writes $OUT/gpu-tests.jsonl (a line per comparison) and $OUT/paths.log.
# PHASES picks (default: versions report dtypes archs).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export SMOE_GPU_REPORT=$OUT/gpu-tests.jsonl SMOE_CACHE=${SMOE_CACHE:-/tmp/smoe-cache}
t() { timeout "$1" python3 -m pytest -q -p no:cacheprovider -m gpu "${@:2}" 2>&1 | tail -25; }
{
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  for phase in ${PHASES:-versions report dtypes archs}; do
    echo "== $phase $(date +%T)"
    case $phase in
    versions) t 60 tests/gpu/test_versions.py ;;
    report)  # the reported case first: gpt_oss, every path, the server, a neighbour
      SMOE_GPU_PATH_ARCHS=gpt_oss t ${REPORT_S:-260} tests/gpu/test_paths.py --durations=5 ;;
    dtypes)
      t ${DTYPES_S:-120} tests/gpu/test_dtypes.py -k "${DTYPES_K:-deepseek or gpt_oss}" ;;
    archs)
      SMOE_GPU_PATH_ARCHS=${ARCHS:-qwen3_moe,qwen2_moe,mixtral,olmoe,deepseek_v2,deepseek_v3} \
        t ${ARCHS_S:-300} tests/gpu/test_paths.py -k every_path --durations=5 ;;
    esac
  done
  echo "== done $(date +%T)"
} 2>&1 | tee "$OUT/paths.log"
