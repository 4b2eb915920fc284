"""Engines that run ``generate()`` in place of a decoding strategy, chosen by ``cache_implementation``.

``generate(..., cache_implementation="paged")`` hands the call to continuous batching, as
transformers 5 does. Continuous batching sits above generation (docs/architecture.md), so
generation does not import it: the engine is registered here by name, as a ``"module:attr"``
string imported on first use, by the ``genkit`` package itself (its ``__init__``, which wires the
layers together). This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["engine_for", "register_engine"]

_ENGINES: dict[str, Any] = {}


def register_engine(cache_implementation: str, engine: Callable[..., Any] | str) -> None:
    """Run ``generate(..., cache_implementation=<name>)`` with ``engine(model, inputs, generation_config,
    refused, kwargs)``: ``refused`` are generate()'s other arguments (the engine refuses those it
    cannot honour), ``kwargs`` the rest. ``engine`` may be a ``"module:attr"`` string."""
    _ENGINES[cache_implementation] = engine


def engine_for(generation_config: Any, kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """The engine registered for the call's ``cache_implementation`` (a keyword argument wins over
    the config's), or None: the strategy loop runs it."""
    name = kwargs["cache_implementation"] if "cache_implementation" in kwargs else getattr(
        generation_config, "cache_implementation", None)
    engine = _ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        return None
    from ..plugins import resolve

    found: Callable[..., Any] = resolve(engine)
    return found
