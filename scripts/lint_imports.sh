#!/usr/bin/env bash
# The layer contract of docs/architecture.md, checked by import-linter ([tool.importlinter] in
# pyproject.toml). import-linter finds a package by walking its folder, and genkit.builtin_strategies
# and genkit.sandbox live outside genkit/ in the repository (package-dir): the check runs on a copy
# laid out as the wheel installs it. Function-level (lazy) imports count like any other.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r genkit "$stage/genkit"
cp -r builtin_strategies "$stage/genkit/builtin_strategies"
cp -r sandbox "$stage/genkit/sandbox"
cd "$stage"
PYTHONPATH="$stage" lint-imports --no-cache "$root/pyproject.toml"
