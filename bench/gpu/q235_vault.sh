#!/usr/bin/env bash
# On the GPU machine: build a 16-layer Qwen3-235B-geometry 4-bit vault (synth one layer,
# convert, grow: bench/grow_vault.py), then measure. STEPS picks what runs (default all):
#   build  io  resident  decode  prefill  tiers
# Figures go to $OUT as JSON (bench_io.json, bench_resident.json, bench_decode.json,
# bench_prefill.json). Issue 48's limit: STEPS="io resident prefill" with RES_PROMPT=1024
# (compute with every expert resident) and PRE_LENGTHS, PRE_SCHEDULES as wanted. Issue
# 50's: STEPS=tiers (bench_tiers.json: decode at each ring budget with each host tier).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-/tmp/data}; mkdir -p "$DATA"
LAYERS=${LAYERS:-16}
V=$DATA/q235-$LAYERS
STEPS=${STEPS:-build io resident decode}
smoe() { python3 -m smoe.cli "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
{
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
  build)
    if [ ! -f "$V/manifest.json" ]; then
      time smoe synth --preset qwen3-235b-a22b --layers 1 --quiet --force "$DATA/src1"
      time smoe convert "$DATA/src1" "$DATA/q235-1" --force
      rm -rf "$DATA/src1"
      time python3 bench/grow_vault.py "$DATA/q235-1" "$V" --layers "$LAYERS"
      rm -rf "$DATA/q235-1"
    fi
    df -h "$DATA"; smoe inspect "$V" | head -3 ;;
  io)
    drop
    smoe bench io "$V" --workers ${IO_WORKERS:-1,4,8,16} --reads ${IO_READS:-160} \
      --repeats ${IO_REPEATS:-2} ${IO_CONTROL:+--control} \
      --path ${IO_PATHS:-unified,staged} --busy ${IO_BUSY:-0,16} > "$OUT/bench_io.json" ;;
  resident)
    drop
    smoe bench resident "$V" --device ${DEVICE:-gpu} --prompt-tokens ${RES_PROMPT:-256} \
      --max-tokens ${RES_TOKENS:-64} > "$OUT/bench_resident${RES_TAG:-}.json" ;;
  decode)
    drop
    smoe bench decode "$V" --device ${DEVICE:-gpu} --budgets ${BUDGETS:-5%,25%,50%,100%} \
      --prompt-tokens ${DEC_PROMPT:-8} --max-tokens ${DEC_TOKENS:-32} \
      --workers ${DEC_WORKERS:-8} > "$OUT/bench_decode.json" ;;
  tiers)
    drop
    smoe bench decode "$V" --device ${DEVICE:-gpu} --budgets ${TIER_BUDGETS:-5%,25%} \
      --host-tiers ${HOST_TIERS:-0,50%,100%} --prompt-tokens ${DEC_PROMPT:-8} \
      --max-tokens ${DEC_TOKENS:-32} --workers ${DEC_WORKERS:-8} > "$OUT/bench_tiers.json" ;;
  prefill)
    drop
    smoe bench prefill "$V" --device ${DEVICE:-gpu} --budgets ${PRE_BUDGETS:-5%} \
      --lengths ${PRE_LENGTHS:-1024} --schedules ${PRE_SCHEDULES:-layer,chunk} \
      --workers ${PRE_WORKERS:-8} > "$OUT/bench_prefill${PRE_TAG:-}.json" ;;
  esac
done
echo "== done $(date +%T)"
} 2>&1 | tee -a "$OUT/q235_vault.log"
