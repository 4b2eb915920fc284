#!/usr/bin/env bash
# The test command: installs everything into .venv, lints (ruff), type-checks (mypy, strict on
# genkit.strategy and genkit.protocols; see [tool.mypy] in pyproject.toml), checks the layers
# (import-linter, scripts/lint_imports.sh), then runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
[ "${GENKIT_SETUP_DRY_RUN:-0}" = 1 ] && exit 0
. .venv/bin/activate
ruff check .
mypy
bash scripts/lint_imports.sh
exec python -m pytest -n 2 -q "$@"
