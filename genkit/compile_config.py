"""``CompileConfig``: transformers' settings for compiling the forward pass in ``generate``.

genkit accepts it for compatibility and **it has no effect**: genkit's ``generate`` never calls
``torch.compile`` (the ``compile_config`` field is listed in ``genkit.config.NO_EFFECT``). Compile
the model yourself (``model.forward = torch.compile(model.forward, **cfg.to_dict())``) if you want
it. As in transformers, ``GenerationConfig.save_pretrained`` does not write ``compile_config``.

This module does not import torch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["CompileConfig", "as_compile_config"]

_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CompileConfig:
    """transformers' ``CompileConfig`` (same fields and defaults); accepted by ``compile_config=``
    and ignored by genkit's ``generate`` (see the module docstring).

    Args:
        fullgraph: require one graph for the whole forward pass.
        dynamic: dynamic shapes (``True``, ``False`` or ``None`` to let torch decide).
        backend: a ``torch.compile`` backend name or callable.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"``.
        options: a dict of backend options, or ``None``.

    >>> CompileConfig(dynamic=True).to_dict()["mode"]
    'reduce-overhead'
    """

    fullgraph: bool = False
    dynamic: bool | None = None
    backend: Any = "inductor"
    mode: str = "reduce-overhead"
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        checks = (
            ("fullgraph", isinstance(self.fullgraph, bool), "True or False"),
            ("dynamic", self.dynamic is None or isinstance(self.dynamic, bool), "True, False or None"),
            ("backend", (isinstance(self.backend, str) and bool(self.backend)) or callable(self.backend),
             "a backend name or a callable"),
            ("mode", self.mode in _MODES, ", ".join(f'"{m}"' for m in _MODES[:-1]) + f' or "{_MODES[-1]}"'),
            ("options", self.options is None or isinstance(self.options, dict), "a dict or None"),
        )
        for key, ok, accepted in checks:
            if not ok:
                raise ConfigError(f"`compile_config.{key}` must be {accepted}; got {getattr(self, key)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (what ``torch.compile`` takes as keyword arguments)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}


def as_compile_config(value: Any) -> Any:
    """The ``compile_config`` field's value: a dict of its keys, or transformers' ``CompileConfig``,
    becomes a :class:`CompileConfig`; anything else passes through (and the field's check refuses it)."""
    if isinstance(value, CompileConfig):
        return value
    if type(value).__name__ == "CompileConfig" and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()
    if isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(CompileConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"`compile_config` has no key {', '.join(map(repr, unknown))}; the keys are "
                              f"{', '.join(sorted(known))}")
        return CompileConfig(**value)
    return value
