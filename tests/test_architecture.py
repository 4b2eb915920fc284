"""Rules of docs/architecture.md that a source walk can check (the layer contract itself is
import-linter's, run by scripts/test.sh through scripts/lint_imports.sh)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("genkit", "builtin_strategies", "sandbox")
MAX_FUNCTION_LINES = 60


def _long_functions(limit: int) -> list[str]:
    found = []
    for root in LIBRARY:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(REPO).as_posix()}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_library_function_is_longer_than_60_lines():
    """Every function of the library (``def`` line to last line, docstring included) fits in 60
    lines: a longer one is split into named steps."""
    long = _long_functions(MAX_FUNCTION_LINES)
    assert not long, f"split these into named functions (at most {MAX_FUNCTION_LINES} lines each):\n" + "\n".join(long)


def test_the_walk_sees_the_functions_it_measures():
    """The check above is not vacuous: with a limit of 5 lines it finds functions in each root."""
    short = _long_functions(5)
    for root in LIBRARY:
        assert any(entry.startswith(f"{root}/") for entry in short), root


def test_the_layer_contract_ignores_only_the_composition_root():
    """No package imports upward (function-level imports included): the contract's only exception
    is ``genkit/__init__.py`` naming the paged engine (docs/architecture.md)."""
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    config = toml.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == "layers"]
    assert contract["ignore_imports"] == ["genkit -> genkit.generation.engines"]
