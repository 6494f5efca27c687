#!/usr/bin/env bash
# On the GPU machine: the disk's limit and mlx-lm's speed, every run.
# STEPS picks what runs (default all), in order:
#   build     the 16-layer Qwen3-235B-geometry 4-bit vault (bench/gpu/q235_vault.sh build)
#   resident  `smoe bench resident` against mlx-lm, RES_RUNS fresh engines (default 3)
#   decode    `smoe bench decode` at 5/25/50/100% with the raw rate of the same run and the
#             warm ring beside the cold one
#   io        `smoe bench io` streamer / raw at 1/4/8/16 workers, quiet and busy, staged and
#             unified, with its A/A control
#   profile   where a streamed step's time goes (bench/step_profile.py) at 25% and 100%
#   overhead  resident decode taken apart: runner loop, Engine.generate, mlx-lm, the graph's
#             build time and size, and a generate_step-shaped loop on each model on the
#             default stream and on mlx-lm's generation stream (bench/resident_overhead.py;
#             the q235 vault and the trained demo)
#   first     the first reply of `smoe chat` on the demo with an empty MLX kernel cache
#             (TMPDIR), against the next, with and without the warm-up (.ci/chat_once.py)
# JSON goes to $OUT, the log to $OUT/speed.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-/tmp/data}; mkdir -p "$DATA"
V=$DATA/q235-16
STEPS=${STEPS:-build overhead resident decode io profile first}
export SMOE_CACHE=$DATA/cache
smoe() { python3 -m smoe.cli "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
{
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
  build)
    STEPS=build OUT=$OUT DATA=$DATA bash bench/gpu/q235_vault.sh ;;
  resident)
    for i in $(seq ${RES_RUNS:-3}); do
      drop
      smoe bench resident "$V" --device gpu --prompt-tokens 256 --max-tokens 64 \
        > "$OUT/resident_$i.json"
    done ;;
  decode)
    drop
    smoe bench decode "$V" --device gpu --budgets ${BUDGETS:-5%,25%,50%,100%} \
      --prompt-tokens 8 --max-tokens ${DEC_TOKENS:-32} --workers ${DEC_WORKERS:-8} \
      > "$OUT/decode.json" ;;
  io)
    drop
    smoe bench io "$V" --workers 1,4,8,16 --reads ${IO_READS:-160} --repeats 2 --control \
      --path unified,staged --busy 0,16 > "$OUT/io.json" ;;
  profile)
    for m in 25% 100%; do
      python3 bench/step_profile.py "$V" --device gpu --memory "$m" --steps 24 \
        > "$OUT/step_profile_${m%\%}.json"
    done ;;
  overhead)
    python3 bench/resident_overhead.py "$V" --device gpu --rounds ${OV_ROUNDS:-3} \
      > "$OUT/resident_overhead.json"
    python3 bench/resident_overhead.py "$(python3 -c 'from smoe.chat.demo import demo_vault
print(demo_vault())')" --device gpu --rounds ${OV_ROUNDS:-3} > "$OUT/resident_overhead_demo.json" ;;
  first)
    for warm in "" "--no-warm-up"; do
      for run in cold again; do
        [ "$run" = cold ] && rm -rf "$DATA/tmp"; mkdir -p "$DATA/tmp"
        TMPDIR=$DATA/tmp MLX_PTX_CACHE_DIR=$DATA/tmp/ptx \
          python3 .ci/chat_once.py "python3 -m smoe.cli chat $warm"
      done
    done ;;
  esac
done
echo "== done $(date +%T)"
} 2>&1 | tee -a "$OUT/speed.log"
