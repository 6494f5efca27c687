#!/usr/bin/env bash
# On the GPU machine: the plan, drafts, KV-bits and run-from-download figures. STEPS picks what runs (default all), in order:
#   build   the 16-layer Qwen3-235B-geometry 4-bit vault (bench/gpu/q235_vault.sh build)
#   test    --kv-bits on CUDA: refused, as mlx-lm cannot run it there (tests/gpu/test_gpu.py)
#   plan    smoe plan's forecast against measured (bench/plan_check.py) at 3 budgets
#           (PLAN_BUDGETS overrides them)
#   draft   --draft ngram / oracle / wrong against plain decode (bench/draft.py)
#   kvbits  KV bytes and speed at a long context, float / 8 / 4 bits (bench/kv_bits.py; CPU
#           and Apple only: refused on CUDA, see docs/performance.md)
#   source  running from the shards against the vault (bench/source_vs_vault.py), for an HF
#           (bf16) and an mlx-community (4-bit) download; SOURCE_LAYERS, SOURCE_RING
# JSON goes to $OUT (plan_check.json, draft_q235.json, draft_demo.json, kv_bits.json,
# source_vs_vault_{hf,mlx4}.json), the log to $OUT/plan_draft_source.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-/tmp/data}; mkdir -p "$DATA"
V=$DATA/q235-16
STEPS=${STEPS:-build test plan draft kvbits source}
export SMOE_CACHE=$DATA/cache
smoe() { python3 -m smoe.cli "$@"; }
{
for step in $STEPS; do
  echo "== $step $(date +%T)"
  case $step in
  build)
    STEPS=build OUT=$OUT DATA=$DATA bash bench/gpu/q235_vault.sh ;;
  test)
    SMOE_GPU_VAULT=$V python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu.py \
      -k "kv_bits" 2>&1 | tail -5 ;;
  plan)
    smoe plan "$V" --device gpu --no-compute --json > "$OUT/plan_q235.json"
    budgets=$(python3 - "$OUT/plan_q235.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
lo, every = p["smallest_memory_bytes"], p["memory_for_every_expert"]
every_b = float(every[:-2]) * (1e9 if every.endswith("GB") else 1e6)
# a small ring, a ring of about half the experts, every expert
print(",".join(f"{b / 1e9:.1f}GB" for b in (lo + 1e9, (lo + every_b) / 2, every_b + 0.2e9)))
EOF
)
    budgets=${PLAN_BUDGETS:-$budgets}  # e.g. PLAN_BUDGETS=7.7GB,17.6GB to re-check two rows
    echo "budgets $budgets"
    python3 bench/plan_check.py "$V" --memory "$budgets" --device gpu --tokens ${PLAN_TOKENS:-24} \
      --repeats ${PLAN_REPEATS:-3} --chunks ${PLAN_CHUNKS:-2} > "$OUT/plan_check.json" ;;
  draft)
    python3 bench/draft.py "$V" --device gpu --ring ${DRAFT_RING:-25%} --tokens ${DRAFT_TOKENS:-48} \
      --trials ${DRAFT_TRIALS:-2} --modes plain,ngram,oracle,wrong > "$OUT/draft_q235.json"
    demo=$(python3 -c 'from smoe.chat.demo import demo_vault; print(demo_vault())')
    python3 bench/draft.py "$demo" --device gpu --ring 25% --tokens 96 --trials 2 \
      --modes plain,ngram,oracle,wrong > "$OUT/draft_demo.json" ;;
  kvbits)
    python3 bench/kv_bits.py "$V" --device gpu --ring all --context ${KV_CONTEXT:-4096} \
      --max-tokens 32 --rounds ${KV_ROUNDS:-2} > "$OUT/kv_bits.json" ;;
  source)
    # an HF download (bf16) and an mlx-community one (4-bit) of the same checkpoint
    for fmt in ${SOURCE_FORMATS:-hf mlx4}; do
      python3 bench/source_vs_vault.py "$DATA/q30-${SOURCE_LAYERS:-8}" --format $fmt \
        --layers ${SOURCE_LAYERS:-8} --ring ${SOURCE_RING:-25%} --rounds ${SOURCE_ROUNDS:-4} \
        --tokens ${SOURCE_TOKENS:-32} > "$OUT/source_vs_vault_$fmt.json"
    done ;;
  esac
done
echo "== done $(date +%T)"
} 2>&1 | tee -a "$OUT/plan_draft_source.log"
