"""genkit's error hierarchy: one root, :class:`GenkitError`, that the CLI (and callers) can catch.

Each error also keeps the builtin base a caller would catch without knowing genkit
(``ValueError`` for bad configuration, ``ImportError`` for unmet requirements, ...), so
``except ValueError`` keeps working::

    GenkitError
    ├── ConfigError (ValueError)            a generation parameter or input is not acceptable
    │   └── NotSupportedError               a valid request this model / strategy cannot serve
    ├── UnknownItemError (ValueError)       no registered strategy/processor/... of that name
    ├── PluginError (RuntimeError)          a plugin failed to load or registered something invalid
    ├── ModelLoadError (OSError)            a model or tokenizer could not be found, fetched or read
    │   └── ModelFileError (ValueError)     a model file is malformed or over a limit (names file, field, limit)
    └── RecipeError                         root of the recipe loader's errors (genkit.recipes.errors)
"""

from __future__ import annotations

__all__ = [
    "ConfigError", "GenkitError", "ModelFileError", "ModelLoadError", "NotSupportedError", "PluginError", "RecipeError",
    "UnknownItemError",
]


class GenkitError(Exception):
    """Root of every error genkit raises on purpose."""


class ConfigError(GenkitError, ValueError):
    """A generation parameter, input or configuration value is not acceptable."""


class NotSupportedError(ConfigError):
    """The request is valid but this model or strategy cannot serve it (e.g. partial depth)."""


class UnknownItemError(GenkitError, ValueError):
    """No registered item (strategy, logits processor, candidate generator, streamer) of that name."""


class PluginError(GenkitError, RuntimeError):
    """A plugin could not be loaded or registered an invalid item."""


class ModelLoadError(GenkitError, OSError):
    """A model or tokenizer could not be found, fetched (offline, no such repo) or read (truncated file)."""


class ModelFileError(ModelLoadError, ValueError):
    """A model file (GGUF or safetensors header, index, config.json) is malformed or exceeds one of
    the documented limits (docs/models.md, "Limits"); the message names the file, the field and
    the limit."""


class RecipeError(GenkitError):
    """Root of the recipe loader's and the sandbox's errors; each subclass keeps a builtin base."""
