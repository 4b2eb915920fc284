"""What ``custom_generate`` names: the one classifier, used by ``generate``, the CLI, serve and batch.

``custom_generate`` is one of (in this order of precedence):

* a callable with the strategy signature (``kind="callable"``);
* the name of a registered strategy (``kind="strategy"``);
* an existing local folder holding ``custom_generate/generate.py`` (``kind="local"``);
* a Hub recipe ``"org/repo"`` or ``"org/repo@revision"`` (``kind="hub"``).

Anything else is an error naming the parameter: a path that does not exist, a malformed Hub id or
revision, or a name that is none of these (an :class:`~genkit.errors.UnknownItemError` listing the
registered strategies). No Hub request and no import of recipe code happens here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, UnknownItemError
from .errors import RecipeNotFoundError
from .resolve import REPO_RE, RecipeRef, parse_ref

__all__ = ["KINDS", "CustomGenerate", "classify"]

KINDS = ("callable", "strategy", "local", "hub")


@dataclass(frozen=True)
class CustomGenerate:
    """A classified ``custom_generate``: its ``kind`` (one of :data:`KINDS`), the ``value`` given,
    and for a recipe its parsed reference (``recipe``)."""

    kind: str
    value: Any
    recipe: RecipeRef | None = None

    @property
    def is_recipe(self) -> bool:
        """A local folder or a Hub repo: code that runs its own ``generate`` (trust rules apply)."""
        return self.kind in ("local", "hub")

    @property
    def ref(self) -> str:
        """The reference as text (a strategy name or a recipe reference); not for a callable."""
        return os.fspath(self.value)


def classify(custom_generate: Any, what: str = "`custom_generate`") -> CustomGenerate | None:
    """Classify ``custom_generate`` (``None``: not given). ``what`` names the parameter in errors
    (the CLI passes ``"--custom-generate"``)."""
    if custom_generate is None:
        return None
    if callable(custom_generate) and not isinstance(custom_generate, os.PathLike):
        return CustomGenerate("callable", custom_generate)
    if not isinstance(custom_generate, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a strategy name, a local folder, a Hub id 'org/repo[@revision]', "
                          f"or a callable; got {type(custom_generate).__name__}")
    from ..plugins import get_registry

    ref = os.fspath(custom_generate)
    strategies = get_registry().items["strategy"]
    if ref in strategies:
        return CustomGenerate("strategy", custom_generate)
    try:
        recipe = parse_ref(ref)
    except RecipeNotFoundError:  # written as a path
        raise ConfigError(f"{what}: the recipe folder {ref!r} does not exist") from None
    except ValueError as exc:
        if REPO_RE.fullmatch(ref.partition("@")[0]):  # a Hub id with a bad revision
            raise ConfigError(f"{what}: {exc}") from None
        raise UnknownItemError(
            f"{what}={ref!r} is not a registered strategy ({', '.join(sorted(strategies))}), an existing local "
            "folder, or a Hub id of the form 'org/repo[@revision]'") from None
    return CustomGenerate(recipe.kind, custom_generate, recipe)
