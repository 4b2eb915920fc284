#!/usr/bin/env bash
# The main job: set up from a fresh clone, then generate with a recipe on the demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec genkit generate "$@"
