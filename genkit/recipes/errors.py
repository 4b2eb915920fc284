"""Exceptions of the recipe loader; each names the recipe and says what to do."""

from __future__ import annotations

from genkit.sandbox.errors import RecipeImportError, SandboxError

#: a recipe's files break a structural or import rule (raised before any of its code runs)
RecipeValidationError = SandboxError


class RecipeTrustError(PermissionError):
    """The recipe would run code the user has not trusted."""


class RecipeFetchError(RuntimeError):
    """The Hub could not be reached or answered with errors after the retries."""


class RecipeNotFoundError(FileNotFoundError):
    """No such repo, revision or local folder."""


class RequirementsError(ImportError):
    """One or more lines of custom_generate/requirements.txt are not satisfied."""


class RequirementsFormatError(ValueError):
    """A line of custom_generate/requirements.txt cannot be accepted (malformed, URL, option)."""


__all__ = [
    "RecipeFetchError", "RecipeImportError", "RecipeNotFoundError", "RecipeTrustError", "RecipeValidationError",
    "RequirementsError", "RequirementsFormatError",
]
