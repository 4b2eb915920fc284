"""genkit's error hierarchy: one root, :class:`GenkitError`, that the CLI (and callers) can catch.

Every error a user can trigger (a bad argument, a model genkit cannot read, a missing kernel) is a
subclass named for what went wrong. Each also keeps the builtin base a caller would catch without
knowing genkit (``ValueError`` for a bad value, ``OSError`` for a model that cannot be loaded,
``RuntimeError`` for a failure while running, ...), so ``except ValueError`` keeps working::

    GenkitError
    ├── ConfigError (ValueError)            an argument, generation parameter or input is not acceptable
    │   ├── NotSupportedError               a valid request this model / strategy cannot serve
    │   │   └── QuantizedWeightError (AttributeError)  a quantized layer's de-quantized ``weight``
    │   │                                   could not be made, or was written to (it is read-only)
    │   ├── NoTokenAllowedError             the constraints of a step (logits processors) allow no token
    │   └── ArgumentTypeError (TypeError)   an argument of the wrong type (a ConfigError that is a TypeError)
    ├── FrozenConfigError (AttributeError)  a resolved (read-only) generation config was written to
    ├── UnknownItemError (ValueError)       no registered strategy/processor/... of that name
    ├── PluginError (RuntimeError)          a plugin failed to load or registered something invalid
    ├── ModelLoadError (OSError)            a model or tokenizer could not be found, fetched or read
    │   ├── CorruptModelError (ValueError)      a model or tokenizer file is corrupt or truncated
    │   │   └── ModelFileError                  a model file is malformed or over a limit (names file, field, limit)
    │   └── UnsupportedModelError (ValueError)  the model uses an architecture, layer or format genkit lacks
    ├── KernelUnavailableError (RuntimeError)  a compute kernel the request needs is missing or failed to build
    ├── GenerationError (RuntimeError)      a generation failed while running (a request, a worker, an engine)
    ├── InvalidStateError (RuntimeError)    an object used in a state that does not allow it (a closed
    │   │                                   manager, an async streamer outside an event loop)
    │   └── QueueFullError                  a bounded queue is full (a manager's max_queue_size)
    └── RecipeError                         root of the recipe loader's and the sandbox's errors
                                            (genkit.recipes.errors, genkit.sandbox.errors)

A builtin exception is raised bare only where a Python protocol demands it (``__getattr__`` raises
``AttributeError``, an iterator ``StopIteration``); ``tests/test_errors.py`` walks the source and
fails on any other bare ``raise ValueError`` / ``TypeError`` / ``RuntimeError``.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError", "ConfigError", "ConfigFileError", "CorruptModelError", "FrozenConfigError", "GenerationError", "GenkitError",
    "InvalidStateError", "KernelUnavailableError", "ModelFileError", "ModelLoadError", "NoTokenAllowedError",
    "NotSupportedError",
    "PluginError", "QuantizedWeightError", "QueueFullError", "RecipeError", "UnknownItemError", "UnsupportedModelError",
]


class GenkitError(Exception):
    """Root of every error genkit raises on purpose."""


class ConfigError(GenkitError, ValueError):
    """A generation parameter, input or configuration value is not acceptable."""


class ConfigFileError(ConfigError, OSError):
    """A ``generation_config.json`` is not valid JSON or holds no JSON object. An ``OSError`` too, as
    transformers raises for it: code that falls back to the model config on ``except OSError`` (as
    transformers' and vLLM's loaders do) works unchanged."""


class NotSupportedError(ConfigError):
    """The request is valid but this model or strategy cannot serve it (e.g. partial depth)."""


class QuantizedWeightError(NotSupportedError, AttributeError):
    """The ``weight`` of a quantized layer (:class:`~genkit.models.quant.Int4Linear`,
    :class:`~genkit.models.quant.QuantizedEmbedding`, :class:`~genkit.models.quant.WithBias`), de-quantized
    on each read, could not be made, or was written to (it is read-only). An ``AttributeError`` too:
    ``hasattr(layer, "weight")``, as transformers, peft and accelerate probe layers, then answers False
    instead of raising."""


class NoTokenAllowedError(ConfigError):
    """The logits processors of a step left no token to choose for a row (every score ``-inf``):
    constraints that contradict each other, e.g. ``suppress_tokens`` over a ``guided_choice``'s only
    tokens. Choosing anyway would emit a token the constraints ruled out (transformers' greedy picks
    token 0, its sampler fails on NaN probabilities)."""


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (``TypeError`` as Python raises for one; also a ``ConfigError``)."""


class FrozenConfigError(GenkitError, AttributeError):
    """A resolved generation config (read-only, what a generation runs with) was written to."""


class UnknownItemError(GenkitError, ValueError):
    """No registered item (strategy, logits processor, candidate generator, streamer) of that name."""


class PluginError(GenkitError, RuntimeError):
    """A plugin could not be loaded or registered an invalid item."""


class ModelLoadError(GenkitError, OSError):
    """A model or tokenizer could not be found, fetched (offline, no such repo) or read (truncated file)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model or tokenizer reference names nothing there: no such folder or file, no config.json,
    weights or tokenizer.json in the folder (a ``FileNotFoundError`` too, as before)."""


class CorruptModelError(ModelLoadError, ValueError):
    """A model or tokenizer file is corrupt, truncated or not the format its name says."""


class ModelFileError(CorruptModelError):
    """A model file (GGUF or safetensors header, index, config.json) is malformed or exceeds one of
    the documented limits (docs/models.md, "Limits"); the message names the file, the field and
    the limit."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The model uses an architecture, layer, activation or weight format genkit does not implement."""


class KernelUnavailableError(GenkitError, RuntimeError):
    """A compute kernel the request needs is not available (no C compiler, a torch build without it)
    or failed to build."""


class GenerationError(GenkitError, RuntimeError):
    """A generation failed while running: a request of a batch, a worker thread, an engine."""


class InvalidStateError(GenkitError, RuntimeError):
    """An object was used in a state that does not allow it (a stopped manager, an async streamer
    created outside a running event loop)."""


class QueueFullError(InvalidStateError):
    """A bounded queue is full (a continuous batching manager's ``max_queue_size`` requests wait)."""


class RecipeError(GenkitError):
    """Root of the recipe loader's and the sandbox's errors; each subclass keeps a builtin base."""


def is_rust_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust library's panic (``tokenizers``, ``llguidance``): pyo3's
    ``PanicException``, a ``BaseException`` that ``except Exception`` lets through, raised for input
    the library did not expect (a hostile ``tokenizer.json``)."""
    return type(exc).__name__ == "PanicException" and type(exc).__module__ == "pyo3_runtime"
