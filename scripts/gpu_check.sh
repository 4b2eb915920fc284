#!/usr/bin/env bash
# genkit's GPU check: tests/test_cuda.py, then bench/bench_gpu.py, on a machine whose python3 has a
# CUDA build of torch (and transformers) but maybe not genkit's other dependencies, and no network.
#
#   bash scripts/gpu_check.sh prepare   here (with network): genkit's wheel and the pure-Python
#                                       packages the GPU machine may lack, into .whl/ (gitignored)
#   bash scripts/gpu_check.sh run       there, in a copy of the repository holding .whl/: installs
#                                       them into /tmp/genkit-site, runs the tests, then the benchmark
#   bash scripts/gpu_check.sh install   only the install step of `run` (scripts/cpu_check.sh calls it)
#
# GPU_CHECK_BENCH="--rounds 3" passes options to bench/bench_gpu.py; GPU_CHECK_BENCH=skip skips it.
# Results are echoed and, when $OUT is set, written there (pytest.log, bench.log).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# what a CUDA image with torch and transformers may lack (the serve extra, the GGUF reader, the
# entry-point reader with its own needs); versions as the dev extra resolves them here
EXTRA_PACKAGES="importlib_metadata lazy-importer zipp gguf starlette uvicorn"

prepare() {
  local py=${PYTHON:-.venv/bin/python}
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  PYTHONWARNINGS=ignore "$py" -m pip wheel -q --no-deps --no-build-isolation . -w "$WHEELS"
  rm -rf build
  local pins=()
  for name in $EXTRA_PACKAGES; do
    pins+=("$name==$("$py" -m pip show "$name" | awk '/^Version:/{print $2}')")
  done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$WHEELS" "${pins[@]}"
  ls "$WHEELS"
}

SITE=/tmp/genkit-site  # where `install` puts the wheels (PYTHONPATH for what runs there)

install() {  # .whl/ into $SITE, beside the machine's own torch (scripts/cpu_check.sh uses it too)
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl
}

run() {
  local py=${PYTHON:-python3} out=${OUT:-/tmp/genkit-gpu-check} repo=$PWD
  case $py in */*) [ "${py#/}" != "$py" ] || py=$repo/$py ;; esac  # a relative path: from the checkout
  mkdir -p "$out"
  PYTHON=$py install
  export PYTHONPATH=$SITE PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  # from outside the checkout, so that the installed genkit is imported, not ./genkit
  (cd /tmp && "$py" -m pytest "$repo/tests/test_cuda.py" -q -rs -p no:cacheprovider 2>&1 | tee "$out/pytest.log" \
    | grep -E "^E  |^FAILED|passed|failed|skipped")
  if [ "${GPU_CHECK_BENCH:-}" != skip ]; then
    # shellcheck disable=SC2086  # the options are words
    "$py" bench/bench_gpu.py ${GPU_CHECK_BENCH:---rounds 3} 2>&1 | grep -v "it/s" | tee "$out/bench.log"
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  install) install ;;
  *) echo "gpu_check.sh: give 'prepare' (here), 'run' (on the GPU machine) or 'install' (the wheels only)" >&2; exit 2 ;;
esac
