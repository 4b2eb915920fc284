"""The config a generation runs with: the call's settings merged over the model's generation
config and the global defaults (:func:`merge_for_generate`), then the lengths for the prompt
(:func:`resolve_lengths`)."""

from __future__ import annotations

import copy
from typing import Any

from ..errors import ConfigError
from .fields import METADATA, field_table, none_means_off
from .generation_config import GenerationConfig
from .warn import warn_once


def merge_for_generate(model_config: GenerationConfig | None, generation_config: GenerationConfig | None,
                       kwargs: dict[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
    """The config a generation runs with, in transformers 5's order: the ``generation_config``
    argument (or a fresh config), then the model's generation config for what it leaves unset
    (custom entries carried over), then the global defaults, then ``kwargs`` (an explicit ``None``
    there means the default, or "off" for a processor's field, as in transformers). Returns the
    config and the ``kwargs`` that are no field.

    The config records the fields the caller set (``_user_set``: the ``generation_config``
    argument's and ``kwargs``) and those that took the global default (``_defaulted``); warnings
    about flags with no effect concern only what the caller set (see :meth:`GenerationConfig.validate`).
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ConfigError(
            f"`generation_config` must be a genkit.GenerationConfig; got {type(generation_config).__name__}"
        )
    config = generation_config.copy() if generation_config is not None else GenerationConfig()
    user_set = generation_config._set_fields() if generation_config is not None else set()
    if model_config is not None:
        inherited = {k: v for k, v in model_config.to_dict().items() if k not in METADATA}
        config._apply(copy.deepcopy(inherited), defaults_only=True, allow_custom_entries=True)
    defaulted = config._fill_defaults()
    table = field_table()
    fields = {k: v for k, v in kwargs.items() if k in table}
    used = config._apply(fields)
    user_set |= used
    defaulted -= used
    defaulted |= config._fill_defaults(keep_none=none_means_off())
    config.validate(user_set_attributes=user_set)
    object.__setattr__(config, "_user_set", frozenset(user_set))
    object.__setattr__(config, "_defaulted", frozenset(defaulted))
    return config, {k: v for k, v in kwargs.items() if k not in table}


def resolve_lengths(config: GenerationConfig, input_length: int, max_positions: int | None = None) -> None:
    """Set ``max_length`` and ``min_length`` for a prompt of ``input_length`` tokens, as transformers
    5 does: ``max_new_tokens`` wins; a ``max_length`` nobody set (the global default, 20) counts
    new tokens, capped at the model's ``max_positions``; ``min_new_tokens`` sets ``min_length``."""
    defaulted = getattr(config, "_defaulted", frozenset())
    user_set = getattr(config, "_user_set", frozenset())
    if config.max_new_tokens is not None:
        if "max_length" in user_set:
            warn_once(f"both `max_new_tokens` (={config.max_new_tokens}) and `max_length` (={config.max_length}) "
                      "are set; `max_new_tokens` takes precedence.")
        object.__setattr__(config, "max_length", input_length + config.max_new_tokens)
    elif "max_length" in defaulted:
        length = config.max_length + input_length
        if max_positions:
            length = min(length, int(max_positions))
        object.__setattr__(config, "max_length", length)
        warn_once(f"generating at most {config.max_length - input_length} new tokens (the model-agnostic default "
                  "`max_length` counts new tokens); set `max_new_tokens` to choose the length.")
    if input_length >= config.max_length:
        raise ConfigError(
            f"`max_length` ({config.max_length}) must be larger than the input length ({input_length}); "
            "set `max_new_tokens` to the number of tokens to generate"
        )
    if config.min_new_tokens is not None:
        object.__setattr__(config, "min_length", input_length + config.min_new_tokens)
