#!/usr/bin/env bash
# Create .venv and install genkit with one extra, from nothing:
#   bash scripts/setup.sh gguf   the main job (scripts/demo.sh): genkit and the GGUF reader
#   bash scripts/setup.sh dev    the tests (scripts/test.sh): everything, transformers included
# torch is pinned first to the CPU wheel this machine carries (a looser pin pulls a CUDA build).
# A stamp in .venv records what was installed for which pyproject.toml: when nothing changed the
# install is skipped (genkit is installed in editable mode, so source edits need no reinstall).
# GENKIT_SETUP_DRY_RUN=1 prints the install it would run instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=${1:-dev}
case "$EXTRA" in gguf|dev) ;; *) echo "setup.sh: unknown extra '$EXTRA'; accepted: gguf, dev" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
STAMP=.venv/.genkit-setup
key() { echo "$1 $(sha256sum pyproject.toml | cut -c1-16) $("$PY" -c 'import sys; print(sys.version.split()[0])')"; }
up_to_date() {
  [ -f "$STAMP" ] || return 1
  grep -qxF "$(key "$EXTRA")" "$STAMP" && return 0
  # the dev extra includes everything the gguf extra has
  [ "$EXTRA" = gguf ] && grep -qxF "$(key dev)" "$STAMP"
}
if [ -x .venv/bin/python ] && up_to_date; then
  exit 0
fi
if [ "${GENKIT_SETUP_DRY_RUN:-0}" = 1 ]; then
  echo "would install: torch==2.13.0, then -e .[$EXTRA] into .venv"
  exit 0
fi
echo "genkit: setting up .venv (genkit[$EXTRA]) ..." >&2
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0"
# (setuptools warns about editable installs of a package-dir layout on every build: not actionable here)
PYTHONWARNINGS=ignore python -m pip install -q -e ".[$EXTRA]"
PY=python
key "$EXTRA" >> "$STAMP"
