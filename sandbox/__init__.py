"""Isolated import of recipe code.

* :func:`scan_tree` reads ``custom_generate/**`` into memory, refusing odd or non-ASCII names,
  links that leave the folder, compiled/binary code and oversized files;
* :func:`check_source` parses every file and applies the import rules (relative imports confined
  to ``custom_generate/``, no absolute imports of the recipe's own files or its siblings, no
  circular module-level imports) — all before any recipe code runs;
* :func:`audit_tree` lists risky imports and calls (processes, network, native code, unpickling,
  dynamic code) for a human to read;
* :func:`import_tree` imports the checked bytes under a private, content-addressed package name.

This confines *imports*; it is not a security boundary against code you chose to trust (see
docs/recipes.md). The trust gate in :mod:`genkit.recipes` is the boundary.
"""

from __future__ import annotations

import ast

from .audit import Finding, audit_module, audit_sources, audit_tree
from .errors import Problem, RecipeImportError, SandboxError
from .importer import PREFIX, import_tree, loaded_modules, module_name
from .imports import check_imports, parse_all
from .tree import FOLDER, SourceTree, check_name, check_relpath, content_hash, scan_tree

__all__ = [
    "FOLDER", "PREFIX", "Finding", "Problem", "RecipeImportError", "SandboxError", "SourceTree", "audit_module",
    "audit_sources", "audit_tree", "check_imports", "check_name", "check_relpath", "check_source", "content_hash",
    "import_tree", "loaded_modules", "module_name", "parse_all", "scan_tree",
]


def check_source(tree: SourceTree) -> tuple[dict[str, ast.Module], list[Problem]]:
    """Parse every file and apply the import rules; returns (parsed modules, problems)."""
    parsed, problems = parse_all(tree)
    problems += check_imports(tree, parsed)
    return parsed, problems
