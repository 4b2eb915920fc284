"""Errors raised by the sandbox: every problem names the file (and line) it was found at."""

from __future__ import annotations

from dataclasses import dataclass

from genkit.errors import RecipeError


@dataclass(frozen=True)
class Problem:
    """One reason a recipe was rejected: ``path`` is relative to the recipe root
    (``custom_generate/...``), ``line`` is 1-based or None for file-level problems."""

    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        return f"{where}: {self.message}"


class SandboxError(RecipeError, ValueError):
    """The recipe's files break a rule checked before any of its code runs."""

    def __init__(self, problems: list[Problem], where: str = "recipe") -> None:
        self.problems = list(problems)
        self.where = where
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{where} was rejected before any of its code ran:\n{lines}")


class RecipeImportError(RecipeError, ImportError):
    """Importing the recipe's modules raised (the recipe's own module-level code failed)."""
