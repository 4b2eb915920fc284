#!/usr/bin/env bash
# The test command: installs everything into .venv, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -n 2 -q "$@"
