"""The config a generation runs with, built in steps that each return a new read-only
:class:`~genkit.config.generation_config.ResolvedConfig` (nothing is written into a config after
it is resolved):

1. :func:`merge_for_generate`: the call's settings over the model's generation config and the
   global defaults;
2. :func:`resolve_special_tokens`: unset special tokens from the model config, ``pad_token_id``
   from the first EOS id;
3. :func:`resolve_lengths`: ``max_length`` / ``min_length`` for the prompt, checked against the
   model's context and, given a :class:`MemoryBudget`, against the memory the generation's
   sequences would hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .checks import model_token_issue, negative_pad_issue
from .fields import METADATA, field_table, is_int, is_num, negative_id, none_means_off
from .generation_config import GenerationConfig, ResolvedConfig, valid_fields
from .warn import warn_once

SPECIAL_TOKENS = ("eos_token_id", "bos_token_id", "pad_token_id")


def merge_for_generate(model_config: GenerationConfig | None, generation_config: GenerationConfig | None,
                       kwargs: dict[str, Any]) -> tuple[ResolvedConfig, dict[str, Any]]:
    """The config a generation runs with, in transformers 5's order: the ``generation_config``
    argument (or a fresh config), then the model's generation config for what it leaves unset
    (custom entries carried over), then the global defaults, then ``kwargs`` (an explicit ``None``
    there means the default, or "off" for a processor's field, as in transformers). Returns the
    config and the ``kwargs`` that are no field.

    The config records the fields the caller set (``user_set``: the ``generation_config``
    argument's and ``kwargs``) and those that took the global default (``defaulted``); warnings
    about flags with no effect concern only what the caller set (see :meth:`GenerationConfig.validate`).
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ConfigError(
            f"`generation_config` must be a genkit.GenerationConfig; got {type(generation_config).__name__}"
        )
    config = generation_config.copy() if generation_config is not None else GenerationConfig()
    user_set = generation_config._set_fields() if generation_config is not None else set()
    if model_config is not None:
        # what the model's config sets (to_diff_dict copies it): unset fields would set nothing here
        inherited = {k: v for k, v in model_config.to_diff_dict().items() if k not in METADATA}
        config._apply(inherited, defaults_only=True, allow_custom_entries=True)
    defaulted = config._fill_defaults()
    table = field_table()
    fields = {k: v for k, v in kwargs.items() if k in table}
    used = config._apply(fields)
    user_set |= used
    defaulted -= used
    defaulted |= config._fill_defaults(keep_none=none_means_off())
    config.validate(user_set_attributes=user_set)
    return ResolvedConfig.of(config, user_set, defaulted), {k: v for k, v in kwargs.items() if k not in table}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if hasattr(value, "reshape") and hasattr(value, "tolist"):  # a tensor or an array, of any shape
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [int(v) for v in value]
    return [int(value)]


def eos_token_ids(value: Any) -> list[int]:
    """An ``eos_token_id`` setting (one id, a list, a tensor, or ``None``) as a list of ids: the one
    place genkit reads EOS ids (re-exported by ``genkit.strategy``). A negative id, transformers'
    "matches no token" sentinel, is left out: it never ends a row and never reaches an index."""
    return [i for i in _ids(value) if i >= 0]


def _negative_ids(config: ResolvedConfig) -> dict[str, Any]:
    """Warn about a negative ``eos_token_id`` / ``pad_token_id`` (transformers' "matches no token"
    sentinel, which transformers accepts with a warning too); the change that makes a negative pad
    id unset."""
    eos = config.eos_token_id
    if negative_id(eos):
        warn_once(f"`eos_token_id` should consist of token ids >= 0, but is {eos!r}: a negative id matches no "
                  "token, so it never ends a row (with no other EOS id, generation will not stop until the "
                  "maximum length is reached).")
    pad_issue = negative_pad_issue(config.pad_token_id)
    if pad_issue is None:
        return {}
    warn_once(pad_issue)
    return {"pad_token_id": None}


def resolve_special_tokens(config: ResolvedConfig, model_tokens: Mapping[str, Any],
                           vocab_size: int | None = None) -> ResolvedConfig:
    """``config`` with its unset special tokens taken from ``model_tokens`` (the model config's, for a
    model without a generation config of its own; an invalid id there is left out) and an unset ``pad_token_id`` set to the first
    EOS id, as transformers does. A negative ``eos_token_id`` / ``pad_token_id`` is warned about: the
    EOS id matches no token (:func:`eos_token_ids` leaves it out), the pad id counts as unset. So does
    a pad id at or past ``vocab_size`` (the model's: the caller's is refused,
    :func:`genkit.config.checks.check_vocabulary`); the pad id defaults to the first EOS id inside it."""
    given = valid_fields({name: model_tokens.get(name) for name in SPECIAL_TOKENS}, field_table())
    changes = {name: value for name, value in given.items() if getattr(config, name) is None}
    config = config.replace(**changes) if changes else config
    changes = _negative_ids(config)
    if changes and given.get("pad_token_id") is not None:  # a negative pad id is unset: the model's applies
        changes["pad_token_id"] = given["pad_token_id"]
    inside = [i for i in eos_token_ids(config.eos_token_id) if vocab_size is None or i < vocab_size]
    pad = changes.get("pad_token_id", config.pad_token_id)
    if vocab_size is not None and pad is not None and pad >= vocab_size:  # the caller's is refused before
        warn_once(model_token_issue("pad_token_id", [pad], vocab_size))
        changes["pad_token_id"] = pad = None
    if pad is None and inside:
        changes["pad_token_id"] = inside[0]
    return config.replace(**changes) if changes else config


def resolve_lengths(config: ResolvedConfig, input_length: int, max_positions: int | None = None, *,
                    prompts: int = 1, memory: MemoryBudget | None = None) -> ResolvedConfig:
    """``config`` with ``max_length`` and ``min_length`` for a prompt of ``input_length`` tokens, as
    transformers 5 sets them: ``max_new_tokens`` wins; a ``max_length`` nobody set (the global
    default, 20) counts new tokens, capped at the model's ``max_positions``; ``min_new_tokens`` sets
    ``min_length``. A length past ``max_positions`` (the model's context) is a :class:`ConfigError`,
    raised before anything is allocated for it; so is, given the ``memory`` budget, a generation of
    ``prompts`` prompts whose sequences would hold more memory than is available
    (:func:`check_memory`)."""
    max_length = config.max_length
    if config.max_new_tokens is not None:
        if "max_length" in config.user_set and config.max_length != input_length + config.max_new_tokens:
            warn_once(f"both `max_new_tokens` (={config.max_new_tokens}) and `max_length` (={config.max_length}) "
                      "are set; `max_new_tokens` takes precedence.")
        max_length = input_length + config.max_new_tokens
    elif "max_length" in config.defaulted:
        max_length = config.max_length + input_length
        if max_positions:
            max_length = min(max_length, int(max_positions))
        warn_once(f"generating at most {max_length - input_length} new tokens (the model-agnostic default "
                  "`max_length` counts new tokens); set `max_new_tokens` to choose the length.")
    if input_length >= max_length:
        raise ConfigError(
            f"`max_length` ({max_length}) must be larger than the input length ({input_length}); "
            "set `max_new_tokens` to the number of tokens to generate"
        )
    if max_positions and input_length >= int(max_positions):
        raise ConfigError(f"the prompt has {input_length} tokens; the model's context (`max_position_embeddings`) is "
                          f"{int(max_positions)}: shorten the prompt to at most {int(max_positions) - 1} tokens, "
                          "which leaves room for one new token")
    if max_positions and max_length > int(max_positions):
        # checked before any buffer or cache is sized from max_length (as vLLM's max_model_len and
        # llama.cpp's n_ctx refuse a request past the context)
        asked = (f"`max_new_tokens` ({max_length - input_length}) with a prompt of {input_length} tokens needs "
                 f"{max_length} positions" if config.max_new_tokens is not None or "max_length" in config.defaulted
                 else f"`max_length` ({max_length}) with a prompt of {input_length} tokens is past the context")
        raise ConfigError(
            f"{asked}; the model's context (`max_position_embeddings`) is {int(max_positions)}: "
            f"ask for at most {max(int(max_positions) - input_length, 0)} new tokens")
    if memory is not None:
        check_memory(config, prompts, input_length, max_length, memory)
    changes = {"max_length": max_length}
    if config.min_new_tokens is not None:
        changes["min_length"] = input_length + config.min_new_tokens
    return config.replace(**changes)


@dataclass(frozen=True)
class MemoryBudget:
    """What one sequence of a generation holds, and the memory there is (for :func:`check_memory`):
    ``per_position`` bytes for each position (its token id, attention mask and key/value cache),
    ``per_sequence`` bytes whatever its length (its logits), ``available`` bytes in all, as
    ``source`` says (``/proc/meminfo``'s MemAvailable, a device's free memory, a setting), and the
    model's ``vocab_size`` (contrastive search has at most that many candidates). ``per_pair``: bytes
    per square of the length (the attention weights ``output_attentions`` records: each step's row
    over the positions before it); ``outputs``: whether the figures count outputs the call records
    (``output_scores``, ...), named in the error."""

    per_position: int
    per_sequence: int
    available: int
    source: str
    vocab_size: int | None = None
    per_pair: int = 0
    outputs: bool = False

    def sequence_bytes(self, length: int) -> int:
        """What one sequence of ``length`` positions holds."""
        return length * self.per_position + length * length * self.per_pair + self.per_sequence

    def longest(self, budget: int) -> int:
        """The most positions one sequence can have within ``budget`` bytes (0: not one)."""
        if budget < self.per_sequence or not (self.per_position or self.per_pair):
            return 0
        if not self.per_pair:
            return (budget - self.per_sequence) // self.per_position
        a, b, c = self.per_pair, self.per_position, self.per_sequence - budget
        n = int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a))
        while n > 0 and self.sequence_bytes(n) > budget:
            n -= 1
        while self.sequence_bytes(n + 1) <= budget:
            n += 1
        return n


def contrastive_candidates(top_k: int, vocab_size: int | None) -> int:
    """The candidates contrastive search runs per step for ``top_k``: at most the vocabulary's
    tokens (a larger ``top_k`` names every token, as ``TopKLogitsWarper`` reads it)."""
    return min(top_k, vocab_size) if vocab_size else top_k


def sequences_per_prompt(config: GenerationConfig, vocab_size: int | None = None) -> tuple[int, str | None]:
    """How many sequences a generation holds at once for each prompt, and the setting that makes it
    more than one: beam search's ``num_beams``; contrastive search's candidates (``top_k``, at most
    the vocabulary, all at once unless ``low_memory``); sampling's ``num_return_sequences``."""
    beams = config.num_beams if is_int(config.num_beams) else 1
    if beams > 1:
        return beams, "num_beams"
    top_k = config.top_k
    if (is_num(config.penalty_alpha) and config.penalty_alpha > 0 and is_int(top_k) and top_k > 1
            and not config.low_memory):
        return contrastive_candidates(top_k, vocab_size), "top_k"
    returned = config.num_return_sequences if is_int(config.num_return_sequences) else 1
    return (returned, "num_return_sequences") if returned > 1 else (1, None)


def check_memory(config: ResolvedConfig, prompts: int, input_length: int, max_length: int,
                 memory: MemoryBudget) -> None:
    """The sequences a generation holds at once (``prompts`` x :func:`sequences_per_prompt`, each
    of up to ``max_length`` positions) fit in ``memory.available``: else a :class:`ConfigError`
    naming the setting that asks for too much and the most that fits, raised before any buffer or
    cache is sized (``num_beams=10**9`` used to ask the allocator for 184 GB of token ids)."""
    width, name = sequences_per_prompt(config, memory.vocab_size)

    def need(width: int, length: int) -> int:
        return prompts * width * memory.sequence_bytes(length)

    total = need(width, max_length)
    if total <= memory.available:
        return
    held = prompts * width
    over = (f"holds {held} sequence{'s' if held != 1 else ''} of up to {max_length} positions at once: about {_size(total)} for "
            f"their token ids, key/value caches{', logits and the outputs recorded' if memory.outputs else ' and logits'}"
            f", more than the {_size(memory.available)} of memory available ({memory.source})")
    new = max_length - input_length
    batch = f"{prompts} prompt{'s' if prompts != 1 else ''} of {input_length} token{'s' if input_length != 1 else ''}"
    if name is not None and need(1, max_length) <= memory.available:
        most = memory.available // need(1, max_length)
        raise ConfigError(f"`{name}` ({getattr(config, name)}) with {batch} and {new} new tokens {over}; at most "
                          f"{most} fit: set `{name}` to {most} or less")
    fit = memory.longest(memory.available // (prompts * width)) - input_length
    what = "max_new_tokens" if config.max_new_tokens is not None or "max_length" in config.defaulted else "max_length"
    setting = f" (`{name}`={getattr(config, name)})" if name is not None else ""
    if fit >= 1:
        raise ConfigError(f"`{what}` ({new if what == 'max_new_tokens' else max_length}) with {batch}{setting} {over}; "
                          f"ask for at most {fit} new tokens")
    raise ConfigError(f"{batch}{setting} {over}; not one new token fits: pass fewer or shorter prompts")


def _size(n: int) -> str:
    """A byte count for people: ``512 bytes``, ``1.5 MiB``, ``11.3 TiB``."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:.1f} {unit}"
