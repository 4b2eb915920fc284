"""Generation configuration, one module per job:

- :mod:`~genkit.config.fields`: the field table (core fields plus the fields plugins declare),
  global defaults and value checks;
- :mod:`~genkit.config.checks`: rules across fields (errors) and flags with no effect (warnings);
- :mod:`~genkit.config.support`: what genkit cannot honour yet (refused) and what has no effect;
- :mod:`~genkit.config.generation_config`: the :class:`GenerationConfig` class;
- :mod:`~genkit.config.files`: where ``generation_config.json`` is read from and written to (a
  folder, a file, a Hub repo);
- :mod:`~genkit.config.resolve`: the config a generation runs with (merge, lengths);
- :mod:`~genkit.config.watermark_field`: the ``watermarking_config`` field (its schemes are read
  from the registry);
- :mod:`~genkit.config.warn`: warnings logged once per process on the ``genkit.config`` logger.

This package does not import torch. Below it sit only ``genkit.errors`` and the registry
(``genkit.plugins``), whose fields are legal config keys.
"""

from __future__ import annotations

from .fields import (
    CORE_FIELDS,
    GENERATION_CONFIG_NAME,
    default_values,
    field_table,
    none_means_off,
    unknown_key_error,
)
from .generation_config import GenerationConfig, ResolvedConfig
from .resolve import merge_for_generate, resolve_lengths, resolve_special_tokens
from .support import NO_EFFECT, NOT_SUPPORTED, check_supported, unsupported_fields
from .warn import WARNED, warn_once

__all__ = [
    "CORE_FIELDS", "GENERATION_CONFIG_NAME", "NO_EFFECT", "NOT_SUPPORTED", "WARNED", "GenerationConfig", "ResolvedConfig",
    "check_supported", "default_values", "field_table", "merge_for_generate", "none_means_off", "resolve_lengths", "resolve_special_tokens",
    "unknown_key_error", "unsupported_fields", "warn_once",
]
