"""Exceptions of the recipe loader; each names the recipe and says what to do."""

from __future__ import annotations

from genkit.errors import RecipeError
from genkit.sandbox.errors import RecipeImportError, SandboxError

#: a recipe's files break a structural or import rule (raised before any of its code runs)
RecipeValidationError = SandboxError


class RecipeTrustError(RecipeError, PermissionError):
    """The recipe would run code the user has not trusted."""


class RecipeFetchError(RecipeError, RuntimeError):
    """The Hub could not be reached or answered with errors after the retries."""


class RecipeNotFoundError(RecipeError, FileNotFoundError):
    """No such repo, revision or local folder."""


class RequirementsError(RecipeError, ImportError):
    """One or more lines of custom_generate/requirements.txt are not satisfied."""


class RequirementsFormatError(RecipeError, ValueError):
    """A line of custom_generate/requirements.txt cannot be accepted (malformed, URL, option)."""


__all__ = [
    "RecipeError", "RecipeFetchError", "RecipeImportError", "RecipeNotFoundError", "RecipeTrustError", "RecipeValidationError",
    "RequirementsError", "RequirementsFormatError",
]
