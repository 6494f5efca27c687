#!/usr/bin/env bash
# On the GPU machine: resident decode against mlx-lm under MLX's CUDA-graph settings, and the
# first reply of `smoe chat` on a fresh machine (issue 27). MLX 0.32's CUDA backend records
# up to MLX_MAX_OPS_PER_BUFFER (20) kernels per graph and keeps MLX_CUDA_GRAPH_CACHE_SIZE
# (400) instantiated graphs keyed by their topology; a miss instantiates a new graph on the
# host. Each setting runs in its own process (MLX reads them once), engine and mlx-lm alike.
# STEPS picks what runs (default: build settings first):
#   build     the 16-layer Qwen3-235B-geometry 4-bit vault (bench/gpu/q235_vault.sh)
#   settings  `smoe bench resident` once per setting in SETTINGS, RUNS times (default 1)
#   first     the demo's first reply: vault built, then kernels cold, then warm
# JSON goes to $OUT (resident_<setting>_<run>.json), the log to $OUT/graphs.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-/tmp/data}; mkdir -p "$DATA"
V=$DATA/q235-16
STEPS=${STEPS:-build settings}
SETTINGS=${SETTINGS:-default cache2000 ops100-cache2000 ops50-cache2000}
export SMOE_CACHE=$DATA/cache
setting_env() {  # the environment of one named setting
  case $1 in
  default) echo "" ;;
  graphs0) echo "MLX_USE_CUDA_GRAPHS=0" ;;
  cache*) echo "MLX_CUDA_GRAPH_CACHE_SIZE=${1#cache}" ;;
  ops*-cache*) local o=${1#ops}; echo "MLX_MAX_OPS_PER_BUFFER=${o%%-*} MLX_CUDA_GRAPH_CACHE_SIZE=${1##*-cache}" ;;
  esac
}
{
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
  build)
    STEPS=build OUT=$OUT DATA=$DATA bash bench/gpu/q235_vault.sh ;;
  settings)
    for run in $(seq ${RUNS:-1}); do
      for s in $SETTINGS; do
        e=$(setting_env "$s")
        env $e python3 -m smoe.cli bench resident "$V" --device gpu --prompt-tokens 256 \
          --max-tokens 64 > "$OUT/resident_${s}_$run.json"
        python3 - "$OUT/resident_${s}_$run.json" "$s" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
e = r["engine"]; s = e["steps"]["by_rows"]["1"]
print(f"{sys.argv[2]:>18}: decode {e['decode_tok_s']:.1f} vs mlx-lm {r['mlx_lm']['decode_tok_s']:.1f}"
      f" = {r['decode_ratio']}x, prefill {r['prefill_ratio']}x, equal {r['tokens_equal']},"
      f" build/queue/wait/period {s['build_ms']}/{s['queue_ms']}/{s['wait_ms']}/{s['period_ms']} ms")
PY
      done
    done ;;
  first)
    python3 -c "from smoe.chat.demo import demo_vault; print(demo_vault())"
    for run in cold again; do
      [ "$run" = cold ] && rm -rf "$DATA/tmp"; mkdir -p "$DATA/tmp"
      echo "-- $run kernels"
      TMPDIR=$DATA/tmp MLX_PTX_CACHE_DIR=$DATA/tmp/ptx \
        python3 .ci/chat_once.py "python3 -m smoe.cli chat"
    done ;;
  esac
done
echo "== done $(date +%T)"
} 2>&1 | tee -a "$OUT/graphs.log"
