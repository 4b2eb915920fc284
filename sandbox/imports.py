"""Static import rules for recipe code, checked on the AST before anything runs.

Allowed: ``from .utils import f``, ``from . import utils``, ``from .pkg.mod import g`` (relative
imports that stay inside custom_generate/) and absolute imports of installed packages.
Refused, with file:line: relative imports that climb out of custom_generate/, relative imports
of files that do not exist, absolute imports of the recipe's own modules (``import utils``,
``import custom_generate.x``), imports of files or folders next to custom_generate/, syntax
errors, and circular module-level imports between the recipe's files. An absolute import of a
name that is also installed (``import json`` in a recipe with a ``json.py``) is allowed: it is
the installed module, as Python and transformers import it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass

from .errors import Problem
from .tree import FOLDER, SourceTree


@dataclass(frozen=True)
class Edge:
    source: str  # module name
    target: str
    path: str  # display path of the importing file
    line: int


def _package_of(rel: str) -> list[str]:
    parts = rel[:-3].split("/")
    return parts[:-1]  # for pkg/__init__.py and pkg/mod.py alike the package is pkg


MAX_AST_DEPTH = 200  # syntax-tree levels; the checks visit the tree recursively


def too_deep(module: ast.AST) -> int | None:
    """The line of the first node nested deeper than :data:`MAX_AST_DEPTH`, or None (iterative)."""
    stack = [(module, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_AST_DEPTH:
            return getattr(node, "lineno", None) or 1
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return None


def parse_all(tree: SourceTree) -> tuple[dict[str, ast.Module], list[Problem]]:
    """Parse every .py file; syntax errors become problems."""
    parsed: dict[str, ast.Module] = {}
    problems: list[Problem] = []
    for rel, data in sorted(tree.files.items()):
        if not rel.endswith(".py"):
            continue
        try:
            module = ast.parse(tree.source(rel), filename=tree.display(rel))
            line = too_deep(module)
            if line is not None:
                problems.append(Problem(tree.display(rel), line, f"code nested deeper than {MAX_AST_DEPTH} levels "
                                        "(an expression or blocks); split it up"))
                continue
            parsed[rel] = module
        except (RecursionError, MemoryError):
            problems.append(Problem(tree.display(rel), None, f"code nested deeper than {MAX_AST_DEPTH} levels "
                                    "(an expression or blocks): Python cannot parse it; split it up"))
        except SyntaxError as exc:
            problems.append(Problem(tree.display(rel), exc.lineno, f"syntax error: {exc.msg}"))
        except ValueError as exc:  # null bytes or bad UTF-8 (UnicodeDecodeError) that slipped through
            problems.append(Problem(tree.display(rel), None, f"cannot parse: {exc}"))
    return parsed, problems


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.depth = 0  # > 0 inside a function body
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def _scope(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self.depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self.depth == 0))


def installed(name: str) -> bool:
    """Whether an absolute import of the top-level ``name`` finds a module outside the recipe: the
    standard library or an installed package (looked up, never imported)."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_imports(tree: SourceTree, parsed: dict[str, ast.Module]) -> list[Problem]:
    """Every import rule violation in the recipe, plus circular module-level imports."""
    modules = tree.modules()
    packages = tree.packages()
    own_top = tree.top_level_names()
    problems: list[Problem] = []
    edges: list[Edge] = []

    def exists(parts: list[str]) -> bool:
        name = ".".join(parts)
        return name in modules or name in packages

    for rel, mod in parsed.items():
        shown = tree.display(rel)
        source_mod = ".".join(p for p in rel[:-3].split("/") if p != "__init__") if rel != "__init__.py" else ""
        visitor = _ImportVisitor()
        visitor.visit(mod)
        for node, top_level in visitor.found:
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = _package_of(rel)
                dots = "." * node.level
                text = f"from {dots}{node.module or ''} import ..."
                if node.level - 1 > len(base):
                    problems.append(Problem(shown, node.lineno, f"`{text}` leaves {FOLDER}/; relative imports "
                                            f"must stay inside {FOLDER}/"))
                    continue
                base = base[: len(base) - (node.level - 1)]
                if node.module:
                    target = base + node.module.split(".")
                    if not exists(target):
                        problems.append(Problem(shown, node.lineno, f"`{text}`: there is no "
                                                f"{FOLDER}/{'/'.join(target)}.py"))
                        continue
                    if top_level:
                        edges.append(Edge(source_mod, ".".join(target), shown, node.lineno))
                else:
                    for alias in node.names:
                        target = base + [alias.name]
                        if exists(target):
                            if top_level:
                                edges.append(Edge(source_mod, ".".join(target), shown, node.lineno))
                        elif ".".join(base + ["__init__"]).replace(".", "/") + ".py" not in tree.files:
                            problems.append(Problem(shown, node.lineno, f"`from {dots} import {alias.name}`: there "
                                                    f"is no {FOLDER}/{'/'.join(target)}.py"))
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top != FOLDER and installed(top):
                    continue  # `import json` next to a json.py: Python (and transformers) import the installed one
                if top == FOLDER or top in own_top:
                    problems.append(Problem(shown, node.lineno, f"absolute import of the recipe's own module "
                                            f"`{name}`; write a relative import (`from .{name.split('.', 1)[-1] if top == FOLDER else name} import ...`)"))
                elif top in tree.outside_names:
                    problems.append(Problem(shown, node.lineno, f"import of `{name}`, which lives next to "
                                            f"{FOLDER}/ (outside the recipe folder); a recipe may only import "
                                            f"its own files, relatively"))
    problems.extend(_cycles(edges))
    return problems


def _cycles(edges: list[Edge]) -> list[Problem]:
    graph: dict[str, list[Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e)
    problems: list[Problem] = []
    seen_cycles: set[frozenset[str]] = set()
    state: dict[str, int] = {}
    stack: list[Edge] = []

    def dfs(node: str) -> None:
        state[node] = 1
        for e in graph.get(node, []):
            if state.get(e.target) == 1:
                start = next(i for i, s in enumerate(stack + [e]) if s.source == e.target)
                cycle = (stack + [e])[start:]
                key = frozenset(c.source for c in cycle)
                if key not in seen_cycles:
                    seen_cycles.add(key)
                    chain = " -> ".join(f"{c.path}:{c.line}" for c in cycle)
                    problems.append(Problem(cycle[0].path, cycle[0].line,
                                            f"circular import between the recipe's modules: {chain}"))
            elif state.get(e.target, 0) == 0:
                stack.append(e)
                dfs(e.target)
                stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if state.get(node, 0) == 0:
            dfs(node)
    return problems
