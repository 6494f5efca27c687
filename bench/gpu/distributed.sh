#!/usr/bin/env bash
# On nvidia-h200-x2: expert parallelism over NCCL, one rank per GPU, against one process.
# Builds the 16-layer Qwen3-235B-geometry vault if missing (q235_vault.sh build), checks NCCL,
# then bench/distributed.py. Figures go to $OUT/bench_distributed.json.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PATH=/tmp/site/bin:$PATH  # mlx.launch, where the wheels were installed
DATA=${DATA:-/tmp/data}
V=$DATA/q235-${LAYERS:-16}
[ -f "$V/manifest.json" ] || STEPS=build bash bench/gpu/q235_vault.sh
cat > /tmp/nccl_check.py <<'PY'
import mlx.core as mx
g = mx.distributed.init(strict=True, backend="nccl")
x = mx.distributed.all_sum(mx.ones((4,)) * (g.rank() + 1), group=g)
mx.eval(x)
print("nccl rank", g.rank(), "of", g.size(), x.tolist(), mx.default_device(), flush=True)
PY
[ -n "${SKIP_CHECK:-}" ] || timeout 120 mlx.launch -n 2 --backend nccl -- "$(command -v python3)" /tmp/nccl_check.py 2>&1 | tail -4
nvidia-smi --query-gpu=index,memory.used --format=csv
python3 bench/distributed.py "$V" --device gpu --backend nccl --slots ${SLOTS:-102} \
  --tokens ${TOKENS:-24} --rounds ${ROUNDS:-2} --workers 8 --temp ${TEMP:-0} \
  > "$OUT/bench_distributed.json" \
  2> "$OUT/bench_distributed.err"
tail -5 "$OUT/bench_distributed.err"
python3 -c "import json; r=json.load(open('$OUT/bench_distributed.json')); print({k: r[k] for k in ('same_tokens','median_decode_tok_s','speedup')})"
