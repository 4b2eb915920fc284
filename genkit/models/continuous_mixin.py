"""``ContinuousMixin``: continuous batching as methods of a model (transformers 5's class name).

Continuous batching (``genkit.continuous``) sits above the models (docs/architecture.md), so this
module does not import it: the functions behind the methods are registered here as
``"module:attr"`` strings by the ``genkit`` package itself (its ``__init__``, the composition
root), and imported on first use. This module does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ContinuousMixin", "register_continuous_batching"]

_FUNCTIONS: dict[str, Any] = {}


def register_continuous_batching(**functions: Any) -> None:
    """Name the functions behind :class:`ContinuousMixin`'s methods (``generate_batch=...``,
    ``init_continuous_batching=...``, ...), each ``function(model, *args, **kwargs)`` or a
    ``"module:attr"`` string."""
    _FUNCTIONS.update(functions)


def _call(name: str, model: Any, *args: Any, **kwargs: Any) -> Any:
    from ..errors import NotSupportedError
    from ..plugins import resolve

    target = _FUNCTIONS.get(name)
    if target is None:
        raise NotSupportedError(f"`{name}` needs genkit's continuous batching, which is not registered "
                                "(import genkit registers it)")
    return resolve(target)(model, *args, **kwargs)


class ContinuousMixin:
    """Continuous batching on a model: ``generate_batch``, ``init_continuous_batching``,
    ``continuous_batching_context_manager`` and ``destroy_cached_continuous_batching_manager``
    (native models get them through ``GenerationMixin``). Each is the function of the same name in
    ``genkit.continuous`` applied to the model; docs/continuous_batching.md has their keywords."""

    def init_continuous_batching(self, generation_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A continuous batching manager (see :func:`genkit.continuous.init_continuous_batching`)."""
        return _call("init_continuous_batching", self, generation_config, *args, **kwargs)

    def continuous_batching_context_manager(self, generation_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A started manager, stopped on exit (see
        :func:`genkit.continuous.continuous_batching_context_manager`)."""
        return _call("continuous_batching_context_manager", self, generation_config, *args, **kwargs)

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Stop and drop the manager this model kept (``persistent_manager=True``)."""
        _call("destroy_cached_continuous_batching_manager", self)

    def generate_batch(self, inputs: list[list[int]], generation_config: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Continuous batching over ``inputs`` (see :func:`genkit.continuous.generate_batch`)."""
        return _call("generate_batch", self, inputs, generation_config, *args, **kwargs)
