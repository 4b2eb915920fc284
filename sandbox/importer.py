"""Import a checked recipe from memory under a private, content-addressed package name.

The recipe's ``custom_generate/`` becomes the package ``_genkit_recipe_<hash>``; its files become
sub-modules (``_genkit_recipe_<hash>.generate``, ``…utils``) served by one meta-path finder that
answers only for that prefix, from the bytes read and checked by :func:`sandbox.tree.scan_tree`.
``sys.path`` is never touched, no public module name is ever bound, and two recipes that both
have a ``utils.py`` live in different packages. A module is loaded once per content hash.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from typing import Any

from .errors import RecipeImportError
from .tree import SourceTree

logger = logging.getLogger("genkit.sandbox")

PREFIX = "_genkit_recipe_"
_lock = threading.RLock()
_loaded: dict[str, types.ModuleType] = {}


def module_name(tree: SourceTree) -> str:
    """The private package name for a tree: ``_genkit_recipe_`` + 24 hex digits of its hash."""
    return PREFIX + tree.content_hash[:24]


class _SourceLoader(importlib.abc.Loader):
    def __init__(self, tree: SourceTree, rel: str | None) -> None:
        self.tree = tree
        self.rel = rel  # None for a folder without __init__.py

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if self.rel is None:
            return
        filename = str(self.tree.folder / self.rel)
        # compile the checked text, never the bytes (Python would obey a `# coding:` line in bytes)
        code = compile(self.tree.source(self.rel), filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the trusted, checked recipe code

    def get_source(self, fullname: str) -> str | None:
        return None if self.rel is None else self.tree.source(self.rel)


class _RecipeFinder(importlib.abc.MetaPathFinder):
    """Answers only for names under a registered private package, and answers all of them: a name
    the recipe's files do not hold is a ModuleNotFoundError, never a search of ``__path__``."""

    def __init__(self) -> None:
        self.trees: dict[str, SourceTree] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PREFIX):
            return None
        top, _, rest = fullname.partition(".")
        tree = self.trees.get(top)
        if tree is None:
            return None
        parts = rest.split(".") if rest else []
        base = "/".join(parts)
        candidates = [(f"{base}/__init__.py" if base else "__init__.py", True)]
        if base:
            candidates.insert(0, (f"{base}.py", False))
        for rel, is_pkg in candidates:
            if rel in tree.files:
                spec = importlib.machinery.ModuleSpec(fullname, _SourceLoader(tree, rel),
                                                      origin=str(tree.folder / rel), is_package=is_pkg)
                spec.has_location = True
                if is_pkg:
                    spec.submodule_search_locations = []
                return spec
        folder = f"{base}/" if base else ""
        if not base or any(r.startswith(folder) for r in tree.files):
            spec = importlib.machinery.ModuleSpec(fullname, _SourceLoader(tree, None), is_package=True)
            spec.submodule_search_locations = []
            return spec
        # never fall through to the other finders: a package's __path__ changed by the recipe
        # (pkgutil.extend_path, __path__.append) must not reach a file outside custom_generate/
        raise ModuleNotFoundError(f"No module named {fullname!r}: custom_generate/ has no {base}.py "
                                  f"or {base}/ (a recipe imports only its own files)", name=fullname)


_finder = _RecipeFinder()


def _install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _purge(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    _finder.trees.pop(name, None)


def import_tree(tree: SourceTree, entry: str = "generate", label: str = "recipe") -> types.ModuleType:
    """Import ``custom_generate/<entry>.py`` of a checked tree and return the module (cached by hash).

    Raises :class:`RecipeImportError` (an ImportError) naming ``label`` when the recipe's code
    raises while importing; nothing of a failed import stays in ``sys.modules``.
    """
    name = module_name(tree)
    with _lock:
        cached = _loaded.get(f"{name}.{entry}")
        if cached is not None:
            return cached
        _install()
        _finder.trees[name] = tree
        before = _import_system()
        try:
            importlib.import_module(name)
            module = importlib.import_module(f"{name}.{entry}")
        except BaseException as exc:
            _undo_import_system_changes(label, before)
            _purge(name)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise RecipeImportError(
                f"{label}: importing custom_generate/{entry}.py failed: {type(exc).__name__}: {exc}"
            ) from exc
        _undo_import_system_changes(label, before)
        _loaded[f"{name}.{entry}"] = module
        return module


_IMPORT_LISTS = ("path", "meta_path", "path_hooks")


def _import_system() -> dict[str, tuple[Any, list[Any]]]:
    """The lists Python imports through (the objects and their items), and the importer cache."""
    state: dict[str, tuple[Any, list[Any]]] = {n: (getattr(sys, n), list(getattr(sys, n))) for n in _IMPORT_LISTS}
    state["path_importer_cache"] = (sys.path_importer_cache, [])
    return state


def _undo_import_system_changes(label: str, before: dict[str, tuple[Any, list[Any]]]) -> None:
    """A recipe may not change where Python imports from: restore ``sys.path``, ``sys.meta_path`` and
    ``sys.path_hooks`` as they were before its import (the same list objects with the same items,
    also when the recipe rebound the names to new objects) and the ``sys.path_importer_cache``
    object, with a warning naming what it changed."""
    for name, (obj, items) in before.items():
        current = getattr(sys, name, None)
        rebound = current is not obj
        if rebound:
            setattr(sys, name, obj)
        if name == "path_importer_cache":
            if rebound:
                logger.warning("%s replaced sys.%s while being imported; the change was undone", label, name)
            continue
        now = list(current) if isinstance(current, (list, tuple)) else []
        if rebound or list(obj) != items:
            added = [x for x in now if x not in items]
            removed = [x for x in items if x not in now]
            obj[:] = items
            logger.warning("%s changed sys.%s while being imported (%sadded %s, removed %s); the change was undone",
                           label, name, "rebound it, " if rebound else "", added or "nothing",
                           removed or "nothing")


def loaded_modules() -> dict[str, types.ModuleType]:
    """The recipe modules loaded in this process (private name -> module)."""
    with _lock:
        return dict(_loaded)
