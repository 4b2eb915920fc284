"""Recipes: decoding code published in the ``custom_generate`` layout (a Hub repo or a local folder).

:func:`load_recipe` runs the loader steps of :mod:`genkit.recipes.pipeline` in order, each only
after the one before has passed: resolve → trust gate → fetch (the listed custom_generate/** and
README.md only, verified) → validate (AST, import rules) → requirements → import through
:mod:`genkit.sandbox` under a private, content-addressed name. ``genkit check`` and ``genkit
inspect`` use the same steps. See docs/recipes.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .errors import (
    RecipeFetchError,
    RecipeImportError,
    RecipeNotFoundError,
    RecipeTrustError,
    RecipeValidationError,
    RequirementsError,
    RequirementsFormatError,
)

logger = logging.getLogger("genkit.recipes")

__all__ = [
    "Recipe", "RecipeFetchError", "RecipeImportError", "RecipeNotFoundError", "RecipeTrustError",
    "RecipeValidationError", "RequirementsError", "RequirementsFormatError", "clear_cache", "load_recipe",
]

_announced: set[tuple[str, str, str]] = set()
_announce_lock = threading.Lock()


@dataclass(frozen=True)
class Recipe:
    """A loaded recipe. ``generate(model, **kwargs)`` is the recipe's own function, unwrapped."""

    ref: str
    path: Path
    commit: str | None
    generate: Callable[..., Any]
    module: Any = field(repr=False)
    content_hash: str = ""
    repo_id: str | None = None
    revision: str | None = None
    trusted_by: str = ""
    findings: tuple[Any, ...] = ()

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        return self.generate(model, **kwargs)


def load_recipe(ref: str | os.PathLike[str], *, trust_remote_code: bool | None = None,
                revision: str | None = None) -> Recipe:
    """Load a recipe from a local folder (containing ``custom_generate/generate.py``) or a Hub repo
    ``'org/repo'`` / ``'org/repo@revision'`` (branch, tag or 40-hex commit sha).

    Hub recipes need ``trust_remote_code=True`` or a matching trusted-repos setting; without it
    :class:`RecipeTrustError` is raised before any recipe file is requested or written. Local
    folders run without it unless ``GENKIT_TRUST_LOCAL_RECIPES=0``. Structural problems raise
    :class:`RecipeValidationError` (a ValueError) listing file:line, unmet requirements one
    :class:`RequirementsError` (an ImportError), Hub failures :class:`RecipeFetchError`.
    """
    from . import pipeline
    from .hub import recipe_deadline

    with recipe_deadline():  # every Hub request of steps 1 and 3: GENKIT_RECIPE_FETCH_TIMEOUT seconds in all
        parsed, commit = pipeline.resolve(ref, revision, trust_remote_code=trust_remote_code, needs_trust=True)  # 1.
        trusted_by = pipeline.gate(parsed, commit, trust_remote_code)  # 2. nothing fetched before this
        if commit is not None:
            cached = _hub_recipes.get(_cache_key(parsed, commit))
            if cached is not None:  # this commit was fetched, checked and imported in this process already
                return replace(cached, ref=os.fspath(ref), revision=parsed.revision, trusted_by=trusted_by)
        source = pipeline.read(parsed, commit)  # 3. fetch: only the listed files, verified, bounded
    checked = pipeline.validate(source)  # 4.
    pipeline.requirements(source, enforce=True)  # 5.
    if checked.findings and parsed.kind == "hub":
        logger.info("%s uses: %s", source.label, "; ".join(str(f) for f in checked.findings))
    module, generate = pipeline.import_generate(source)  # 6.
    tree = source.tree
    if parsed.kind == "hub" and not parsed.pinned:
        key = (parsed.repo_id or "", parsed.revision, commit or "")
        with _announce_lock:
            if key not in _announced:
                _announced.add(key)
                logger.warning("running recipe %s at revision %r = commit %s; pin it with custom_generate='%s@%s'",
                               parsed.repo_id, parsed.revision, commit, parsed.repo_id, commit)
    recipe = Recipe(ref=os.fspath(ref), path=tree.root, commit=commit, generate=generate, module=module,
                    content_hash=tree.content_hash, repo_id=parsed.repo_id, revision=parsed.revision
                    if parsed.kind == "hub" else None, trusted_by=trusted_by, findings=tuple(checked.findings))
    if parsed.kind == "hub" and commit is not None:
        with _cache_lock:
            _hub_recipes[_cache_key(parsed, commit)] = recipe
    return recipe


# -- no network per call: loaded Hub recipes by (repo, commit); unpinned revisions re-resolved at
# most once per GENKIT_RECIPE_RESOLVE_INTERVAL seconds (default 60; 0 = every call)
_hub_recipes: dict[tuple[str, ...], Recipe] = {}
_resolved: dict[tuple[str, ...], tuple[str, float]] = {}
_cache_lock = threading.Lock()
DEFAULT_RESOLVE_INTERVAL = 60.0


def resolve_interval() -> float:
    """Seconds a branch or tag -> commit resolution is reused (``GENKIT_RECIPE_RESOLVE_INTERVAL``)."""
    raw = os.environ.get("GENKIT_RECIPE_RESOLVE_INTERVAL")
    if raw is None:
        return DEFAULT_RESOLVE_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConfigError(f"GENKIT_RECIPE_RESOLVE_INTERVAL={raw!r} is not accepted; use a number of seconds >= 0")
    return value


def _commit_of(parsed: Any, resolve_commit: Callable[[Any], str]) -> str:
    """The commit of a Hub reference: a pinned sha as is; a branch or tag resolved again only when its
    last resolution is older than :func:`resolve_interval` (offline resolution reads the cache)."""
    interval = resolve_interval()
    if parsed.pinned:
        return str(parsed.revision)
    key = _cache_key(parsed, parsed.revision)
    now = time.monotonic()
    with _cache_lock:
        hit = _resolved.get(key)
    if hit is not None and now - hit[1] < interval:
        return hit[0]
    commit = resolve_commit(parsed)
    with _cache_lock:
        _resolved[key] = (commit, now)
    return commit


def _cache_key(parsed: Any, rev: str) -> tuple[str, ...]:
    """A Hub (endpoint + cache folder), a repo and a revision: recipes of two Hubs never mix."""
    from .settings import hub_cache_dir, hub_endpoint

    return (hub_endpoint(), str(hub_cache_dir()), parsed.repo_id or "", rev)


def clear_cache() -> None:
    """Forget loaded Hub recipes and revision resolutions (the next load asks the Hub again)."""
    with _cache_lock:
        _hub_recipes.clear()
        _resolved.clear()
