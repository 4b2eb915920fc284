#!/usr/bin/env bash
# Create .venv and install genkit with what the demo and the tests need, from nothing.
# torch is pinned first to the CPU wheel this machine carries (a looser pin pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
