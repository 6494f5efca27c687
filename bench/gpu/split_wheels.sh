#!/usr/bin/env bash
# After ../shared/tools/device-wheels: re-split the CUDA wheel into three parts so each device
# call stays under the tool's 64 MiB (the working tree alone is ~30 MB, the demo model's
# weights most of it; device-wheels' two 45 MB parts no longer fit beside it). Then, each
# call right after the last (the machine is given back ~30 s after a call):
#   run 1: carry [".whl/a"]  command: bash .whl/a/stash.sh
#   run 2: carry [".whl/c"]  command: bash .whl/c/stash.sh
#   run 3: carry [".whl/b"]  command: bash .whl/b/setup.sh && . /tmp/site/env.sh && ...
# (setup.sh joins /tmp/whl/cuda.part.* in name order: aa, ab, ac.)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)/.whl"
[ -e a/cuda.part.aa ] && [ -e b/cuda.part.ab ] || { echo "run ../shared/tools/device-wheels first"; exit 2; }
tmp=$(mktemp -d)
cat a/cuda.part.aa b/cuda.part.ab > "$tmp/cuda.whl"
rm a/cuda.part.aa b/cuda.part.ab
mkdir -p c
split -b 33M "$tmp/cuda.whl" "$tmp/part."
mv "$tmp/part.aa" a/cuda.part.aa
mv "$tmp/part.ab" c/cuda.part.ab
mv "$tmp/part.ac" b/cuda.part.ac
sed 's#.whl/a/#.whl/c/#' a/stash.sh > c/stash.sh
rm -r "$tmp"
du -sh a b c
