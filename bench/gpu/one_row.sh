#!/usr/bin/env bash
# On the GPU machine: one row, one arithmetic (batched serving, drafts, the rules). STEPS picks what runs
# (default all), in order:
#   build     the 16-layer Qwen3-235B-geometry 4-bit vault (bench/gpu/q235_vault.sh build)
#   fingerprint  which ops change a row's bits with the row count (bench/gpu/row_fingerprint.py)
#   serve     `smoe serve` aggregate tok/s at 1, 2, 4, 8 clients, batched against one at a
#             time, at a 5% ring and with every expert resident (bench/serve_clients.py),
#             for the q235 vault and the trained demo (SERVE_VAULTS picks: q235 demo;
#             SERVE_ARGS adds options to the q235 runs, e.g. --client-process, and
#             SERVE_TAG to their file names)
#   draft     --draft ngram and an oracle against plain decode at 5% and 50% rings
#             (bench/draft.py)
#   cost      resident decode with the kernel rules against without (bench/solo_rows_cost.py)
#   timeline  a batched step's host build, evaluation and read-back at 1-8 rows, rules on
#             and off (bench/batch_build_cost.py), for the q235 vault and the trained demo
#   tests     the exactness tests (tests/gpu/test_gpu.py; SMOE_GPU_ARCHS / SMOE_GPU_BITS pick)
# JSON goes to $OUT, the log to $OUT/one_row.log, the tests' comparisons to
# $OUT/gpu-tests.jsonl. Run after bench/gpu/setup.sh (it carries MLX with CUDA and the
# versions pyproject.toml declares, pytest and pytest-asyncio included).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-/tmp/data}; mkdir -p "$DATA"
V=$DATA/q235-16
STEPS=${STEPS:-build fingerprint serve draft cost timeline tests}
export SMOE_CACHE=$DATA/cache
demo() { python3 -c 'from smoe.chat.demo import demo_vault; print(demo_vault())'; }
{
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
  build)
    STEPS=build OUT=$OUT DATA=$DATA bash bench/gpu/q235_vault.sh ;;
  fingerprint)
    python3 bench/gpu/row_fingerprint.py --costs > "$OUT/fingerprint-bf16.json" ;;
  serve)
    for ring in ${SERVE_RINGS:-5% all}; do
      fill=""; [ "$ring" = all ] && fill=--fill
      name=${ring%\%}
      case " ${SERVE_VAULTS:-q235 demo} " in *" q235 "*)
        python3 bench/serve_clients.py "$V" --memory "$ring" $fill --clients ${CLIENTS:-1,2,4,8} \
          --max-tokens ${SERVE_TOKENS:-32} --prompt-tokens 16 ${SERVE_ARGS:-} \
          > "$OUT/serve_q235_$name${SERVE_TAG:-}.json" ;;
      esac
      case " ${SERVE_VAULTS:-q235 demo} " in *" demo "*)
        python3 bench/serve_clients.py "$(demo)" --memory "$ring" $fill \
          --clients ${CLIENTS:-1,2,4,8} --max-tokens 64 --prompt-tokens 16 \
          > "$OUT/serve_demo_$name.json" ;;
      esac
    done ;;
  draft)
    for ring in ${DRAFT_RINGS:-5% 50%}; do
      name=${ring%\%}
      python3 bench/draft.py "$V" --device gpu --ring "$ring" --tokens ${DRAFT_TOKENS:-48} \
        --trials ${DRAFT_TRIALS:-2} --modes plain,ngram,oracle > "$OUT/draft_q235_$name.json"
    done
    python3 bench/draft.py "$(demo)" --device gpu --ring 25% --tokens 96 --trials 2 \
      --modes plain,ngram,oracle > "$OUT/draft_demo.json" ;;
  cost)
    python3 bench/solo_rows_cost.py "$V" --device gpu --rounds ${COST_ROUNDS:-4} \
      --tokens 64 > "$OUT/solo_rows_cost_q235.json" ;;
  timeline)
    python3 bench/batch_build_cost.py "$V" --device gpu > "$OUT/batch_build_cost_q235.json"
    python3 bench/batch_build_cost.py "$(demo)" --device gpu > "$OUT/batch_build_cost_demo.json" ;;
  tests)
    SMOE_GPU_REPORT=$OUT/gpu-tests.jsonl python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/gpu/test_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -15 ;;
  esac
done
echo "== done $(date +%T)"
} 2>&1 | tee -a "$OUT/one_row.log"
