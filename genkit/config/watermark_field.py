"""The ``watermarking_config`` field: which values it accepts and how a dict becomes a config object.

The watermark schemes are a registry kind (``register_watermarks``): the field reads the registered
config classes from the registry (below this package) instead of importing ``genkit.watermarking``
(above it). A dict, as ``generation_config.json`` holds it, becomes the registered class that has
the most of its keys.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from ..plugins import get_registry

logger = logging.getLogger("genkit.watermarking")

__all__ = ["as_watermarking_config", "is_watermarking_config", "registered_watermark_configs",
           "watermark_config_keys"]


def watermark_config_keys(cls: type) -> tuple[str, ...]:
    """The keys of a watermark config class: its dataclass fields, else its ``__init__`` parameters."""
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls) if not f.name.startswith("_"))
    params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    return tuple(p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def registered_watermark_configs() -> list[type]:
    """The watermark config classes registered through the ``register_watermarks`` hook
    (built-ins first: genkit's ``WatermarkingConfig``, then the packs')."""
    return [item.load() for item in get_registry().items["watermark"].values()]


def as_watermarking_config(value: Any) -> Any:
    """The ``watermarking_config`` field's value: a dict becomes the registered watermark config
    class that has the most of its keys (the first registered, genkit's ``WatermarkingConfig``,
    for an empty dict or a tie, as transformers reads ``generation_config.json``); a config object
    passes through."""
    if not isinstance(value, dict):
        return value
    classes = registered_watermark_configs()
    best, best_hits = classes[0], 0
    for cls in classes:
        hits = len(set(value) & set(watermark_config_keys(cls)))
        if hits > best_hits:
            best, best_hits = cls, hits
    logger.debug("watermarking_config dict read as %s", best.__name__)
    return best.from_dict(value)  # type: ignore[attr-defined]


def is_watermarking_config(value: Any) -> bool:
    """A watermark config: an object with ``construct_processor``, ``to_dict`` and ``validate``
    whose ``validate()`` passes."""
    if not all(callable(getattr(value, m, None)) for m in ("construct_processor", "to_dict", "validate")):
        return False
    value.validate()
    return True
