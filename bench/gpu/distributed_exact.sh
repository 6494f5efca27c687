#!/usr/bin/env bash
# On nvidia-h200-x2: 2 ranks over NCCL against one GPU process, logits compared bit for bit,
# on the synthetic demo model (qwen3_moe, 6 layers of 16 experts) at 4 and 16 bits.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TMPDIR=/tmp
export PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
D=/tmp/exact; mkdir -p $D
[ -d $D/src ] || python3 -m smoe.cli synth --preset demo --quiet --force $D/src
for bits in 4 16; do
  [ -f $D/v$bits/manifest.json ] || python3 -m smoe.cli convert $D/src $D/v$bits --bits $bits --quiet --force
  python3 bench/distributed_exact.py $D/v$bits --slots 24 --backend nccl --device gpu \
    > "$OUT/distributed_exact_$bits.json" 2> "$OUT/distributed_exact_$bits.err"
  python3 -c "import json; r=json.load(open('$OUT/distributed_exact_$bits.json')); print($bits, [(x['prefill_logits'], x['decode_logits'], x['same_tokens']) for x in r['ranks']])" || tail -5 "$OUT/distributed_exact_$bits.err"
done
