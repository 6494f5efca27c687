#!/usr/bin/env bash
# The GPU machine's Python packages, at the versions pyproject.toml declares. Its image has
# no package index and its own versions (transformers 5.17, below our floor; no MLX), and
# one device call carries at most 64 MiB beside the ~31 MB working tree, while the CUDA
# wheel alone is ~90 MB: so the wheels travel in four parts (~30 MB), one call each.
#
# Here, in the project root:   bash bench/gpu/setup.sh prepare     (.whl/a .whl/b .whl/c .whl/d)
# Then four device runs, each right after the last (the machine stays warm ~30 s):
#   run 1: carry [".whl/a"]  command: bash bench/gpu/setup.sh stash a
#   run 2: carry [".whl/b"]  command: bash bench/gpu/setup.sh stash b
#   run 3: carry [".whl/c"]  command: bash bench/gpu/setup.sh stash c
#   run 4: carry [".whl/d"]  command: bash bench/gpu/setup.sh install && . /tmp/site/env.sh && ...
# install puts everything into /tmp/site (first on PYTHONPATH, so it wins over the image's)
# and prints the versions; tests/gpu/test_versions.py checks them against pyproject.toml.
# The CLI then runs as `python3 -m smoe.cli ARGS`. Later calls on the same warm machine
# need only `. /tmp/site/env.sh`; if install says a part is missing, the machine was given
# back between the calls: run the stashes again.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# What the image lacks or has at another version than ours (with what they need).
PINNED="transformers==5.25.0 huggingface_hub==2.4.0 kernels==0.19.1 tomlkit httpx2==2.17.0
  httpcore2==2.17.0 truststore hf-xet==1.8.0 pytest==9.2.0
  pytest-asyncio==1.5.0 pluggy==1.7.0 iniconfig==2.3.1 uvloop==0.22.1 aiofiles==25.1.0
  prompt_toolkit wcwidth tqdm xxhash==4.1.0 greenlet==3.5.6"

dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl/dl "$@"
}

case "${1:-}" in
prepare)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir -p .whl/dl .whl/a .whl/b .whl/c .whl/d
  mlx=$(python3 -c 'import importlib.metadata as m; print(m.version("mlx"))')
  mlxlm=$(python3 -c 'import importlib.metadata as m; print(m.version("mlx-lm"))')
  dl "mlx==$mlx" "mlx-cuda-13==$mlx" "mlx-lm==$mlxlm"
  # shellcheck disable=SC2086
  dl $PINNED
  big=$(ls .whl/dl/mlx_cuda_13-*.whl)
  basename "$big" > .whl/d/cuda.name
  split -n 3 -d "$big" .whl/dl/cuda.part.
  mv .whl/dl/cuda.part.00 .whl/a/ && mv .whl/dl/cuda.part.01 .whl/b/ && mv .whl/dl/cuda.part.02 .whl/c/
  rm "$big"
  mv .whl/dl/*.whl .whl/d/
  rmdir .whl/dl
  du -sh .whl/a .whl/b .whl/c .whl/d ;;
stash)
  mkdir -p /tmp/whl && cp ".whl/$2"/cuda.part.* /tmp/whl/ && ls -la /tmp/whl ;;
install)
  if [ ! -f /tmp/site/.done ]; then
    for part in 00 01 02; do
      [ -e /tmp/whl/cuda.part.$part ] || { echo "cuda.part.$part missing: run the stashes again"; exit 3; }
    done
    name=$(cat .whl/d/cuda.name)
    cat /tmp/whl/cuda.part.0[0-2] > "/tmp/whl/$name"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "/tmp/whl/$name" .whl/d/*.whl
    # MLX's CUDA build loads the CUDA libraries of the nvidia-* wheels beside the image's torch.
    ld=$(python3 - <<'PY'
import glob, os, site
dirs = set()
for base in site.getsitepackages() + ["/opt/torch/.venv/lib/python3.12/site-packages"]:
    for so in glob.glob(os.path.join(base, "nvidia", "**", "lib", "*.so*"), recursive=True):
        dirs.add(os.path.dirname(so))
print(":".join(sorted(dirs)))
PY
)
    echo "export PYTHONPATH=/tmp/site:\$PWD LD_LIBRARY_PATH=$ld\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" > /tmp/site/env.sh
    touch /tmp/site/.done
  fi
  # shellcheck disable=SC1091
  . /tmp/site/env.sh
  python3 -c "
import importlib.metadata as m, mlx.core as mx
print('mlx', mx.__version__, mx.default_device(), {n: m.version(n) for n in
      ('mlx-lm', 'transformers', 'huggingface_hub', 'tokenizers', 'numpy', 'pytest-asyncio')})" ;;
*)
  echo "usage: bash bench/gpu/setup.sh prepare | stash a|b|c | install" >&2; exit 2 ;;
esac
