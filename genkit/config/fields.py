"""The fields of a ``GenerationConfig``: their names, global defaults and validators.

The legal fields are :data:`CORE_FIELDS` plus the fields registered plugins declare
(:class:`~genkit.plugins.FieldSpec`, looked up in the registry on each call of :func:`field_table`),
so a pack can add a knob. The registry (``genkit.plugins``) sits below this package: it imports
only ``genkit.errors``.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Callable, Iterable
from numbers import Integral, Real
from typing import Any

from ..errors import ConfigError
from ..plugins import FieldSpec, get_registry
from .watermark_field import as_watermarking_config, is_watermarking_config

GENERATION_CONFIG_NAME = "generation_config.json"
# metadata transformers writes next to the settings: kept as read and written back
METADATA = ("transformers_version", "_from_model_config")
# metadata transformers once wrote and no longer reads
DROPPED_METADATA = ("_commit_hash", "_original_object_hash")
# generate() arguments; a config holding one is an error (as in transformers)
GENERATE_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                       "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask")
# the cache implementations transformers accepts
CACHE_IMPLEMENTATIONS = ("dynamic", "static", "offloaded", "offloaded_static", "quantized", "sliding_window",
                          "hybrid", "hybrid_chunked", "offloaded_hybrid", "offloaded_hybrid_chunked", "paged")
EXTRA_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def is_finite(v: Any) -> bool:
    """A number, neither infinite nor NaN (JSON's ``1e999`` is Python's ``inf``)."""
    return is_num(v) and math.isfinite(v)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _token_id(v: Any) -> bool:
    return is_int(v) and v >= 0


def _token_ids(v: Any, one: Any = _token_id) -> bool:
    """One id or a non-empty list of ids (each passing ``one``)."""
    if one(v):
        return True
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(one(x) for x in v)


def negative_id(v: Any) -> bool:
    """Whether ``v`` (one id or a list of ids) holds a negative id, transformers' "matches no token"
    sentinel."""
    return any(is_int(x) and x < 0 for x in (v if isinstance(v, (list, tuple)) else [v]))


def _id_or_sentinel(v: Any) -> bool:
    """A token id, or a negative int: transformers' "matches no token" sentinel, accepted with a
    warning for ``eos_token_id`` / ``pad_token_id`` only (:mod:`genkit.config.resolve`)."""
    return is_int(v)


# the ints a token id may be: torch holds ids as int64 (an id past it failed with "Overflow when
# unpacking long long" where the ids became a tensor)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def past_int64(ids: Iterable[Any]) -> list[int]:
    """The ints among ``ids`` that no int64 holds, sorted, each once."""
    return sorted({int(i) for i in ids if is_int(i) and not INT64_MIN <= i <= INT64_MAX})


def token_ids_in(v: Any) -> list[Any]:
    """The ints a token-id value holds at any depth: one id, a list of ids, lists of those (a
    :class:`~genkit.plugins.FieldSpec`'s ``token_ids``)."""
    found, todo = [], [v]
    while todo:
        x = todo.pop()
        if isinstance(x, (list, tuple)):
            todo.extend(x)
        elif is_int(x):
            found.append(x)
    return found


def _str_or_strs(v: Any) -> bool:
    if isinstance(v, str):
        return len(v) > 0
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(s, str) and s for s in v)


def _F(name: str, default: Any, check: Any = None, accepted: str = "", doc: str = "", coerce: Any = None,
       token_ids: Any = None) -> FieldSpec:
    return FieldSpec(name, default, check, accepted, doc, coerce, token_ids=token_ids)


def _constraint_list(v: Any) -> bool:
    """A list of phrases / disjunctive sets, or of objects with ``token_ids`` (transformers 4's constraints)."""
    return isinstance(v, list) and all(isinstance(c, (list, tuple)) or isinstance(getattr(c, "token_ids", None),
                                                                                  (list, tuple)) for c in v)


def _as_constraint_list(v: Any) -> Any:
    """A constraint object becomes its ``token_ids`` (a phrase, or a disjunctive set's phrases), so
    the config holds plain lists, as ``force_words_ids`` does."""
    if not _constraint_list(v):
        return v
    return [list(c) if isinstance(c, (list, tuple)) else [list(p) if isinstance(p, (list, tuple)) else p
                                                          for p in c.token_ids] for c in v]


def _compile_config(v: Any) -> bool:
    from ..compile_config import CompileConfig

    return isinstance(v, CompileConfig)


def _as_compile_config(v: Any) -> Any:
    from ..compile_config import as_compile_config

    return as_compile_config(v)


# Fields the core owns, with their global defaults (the value generate uses when neither the call
# nor the model's generation config sets one). Processor fields (temperature, top_k, ...) are
# declared by the built-in processors in ``builtin_strategies.fields`` through the registry, like a
# pack's fields.
CORE_FIELDS: tuple[FieldSpec, ...] = (
    # length
    _F("max_length", 20, lambda v: is_int(v) and v >= 1, "an int >= 1",
       "Maximum total length (prompt + new tokens); overridden by max_new_tokens."),
    _F("max_new_tokens", None, lambda v: is_int(v) and v >= 1, "an int >= 1 or None",
       "Maximum number of tokens to generate, ignoring the prompt."),
    _F("min_length", 0, lambda v: is_int(v) and v >= 0, "an int >= 0"),
    _F("min_new_tokens", None, lambda v: is_int(v) and v >= 0, "an int >= 0 or None"),
    _F("early_stopping", False, lambda v: v in (True, False, "never"), 'True, False or "never"'),
    _F("max_time", None, lambda v: is_num(v) and v > 0, "a number of seconds > 0 or None"),
    _F("stop_strings", None, _str_or_strs, "a non-empty string or list of non-empty strings"),
    # strategy
    _F("do_sample", False, _is_bool, "True or False"),
    _F("num_beams", 1, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    _F("num_beam_groups", 1, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    _F("diversity_penalty", 0.0, lambda v: is_finite(v) and v >= 0, "a finite number >= 0"),
    _F("length_penalty", 1.0, is_finite, "a finite number (exponent on the sequence length)"),
    _F("penalty_alpha", None, lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] or None"),
    _F("dola_layers", None, lambda v: v in ("low", "high") or (isinstance(v, list) and all(is_int(x) for x in v)),
       '"low", "high", a list of layer indices, or None'),
    _F("force_words_ids", None, lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list or None",
       token_ids=token_ids_in),
    _F("constraints", None, _constraint_list, "a list of constraints (each a phrase or a disjunctive set "
       "as in force_words_ids, or an object with `token_ids` such as transformers 4's PhrasalConstraint and "
       "DisjunctiveConstraint) or None", coerce=_as_constraint_list, token_ids=token_ids_in),
    _F("use_cache", True, _is_bool, "True or False"),
    _F("cache_implementation", None, lambda v: v in CACHE_IMPLEMENTATIONS,
       ", ".join(f'"{v}"' for v in CACHE_IMPLEMENTATIONS) + " or None"),
    _F("cache_config", None),
    _F("max_cache_len", None, lambda v: is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("use_mtp", None),
    _F("compile_config", None, _compile_config, "a genkit.CompileConfig (or a dict of its keys) or None; it has "
       "no effect in genkit", coerce=_as_compile_config),
    _F("disable_compile", None),
    _F("continuous_batching_config", None, lambda v: isinstance(v, dict) or callable(getattr(v, "to_dict", None)),
       "a genkit.ContinuousBatchingConfig, a dict of its keys, or None"),
    _F("low_memory", None, _is_bool, "True, False or None"),
    _F("prefill_chunk_size", None, lambda v: is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("token_healing", False, _is_bool, "True or False"),
    _F("guidance_scale", None, lambda v: is_num(v) and 0 <= v < float("inf"),
       "a finite number >= 0 (1 turns classifier-free guidance off) or None"),
    _F("watermarking_config", None, is_watermarking_config,
       "a genkit.WatermarkingConfig, a dict of its keys, or another watermark config object "
       "(construct_processor, to_dict, validate), or None", coerce=as_watermarking_config),
    _F("num_return_sequences", 1, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    # outputs
    _F("output_attentions", False, _is_bool, "True or False"),
    _F("output_hidden_states", False, _is_bool, "True or False"),
    _F("output_scores", False, _is_bool, "True or False"),
    _F("output_logits", None, lambda v: _is_bool(v), "True, False or None"),
    _F("return_dict_in_generate", False, _is_bool, "True or False"),
    # special tokens
    _F("pad_token_id", None, _id_or_sentinel, "a token id >= 0 (a negative id is treated as unset, with a "
       "warning) or None", token_ids=token_ids_in),
    _F("bos_token_id", None, _token_id, "a token id >= 0 or None", token_ids=token_ids_in),
    _F("eos_token_id", None, lambda v: _token_ids(v, _id_or_sentinel), "a token id >= 0, a non-empty list of ids "
       "(a negative id matches no token, with a warning), or None", token_ids=token_ids_in),
    _F("decoder_start_token_id", None, _token_ids, "a token id >= 0 or None", token_ids=token_ids_in),
    # assisted decoding
    _F("is_assistant", False, _is_bool, "True or False"),
    _F("num_assistant_tokens", 20, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    _F("num_assistant_tokens_schedule", "constant", lambda v: v in ("constant", "heuristic", "heuristic_transient"),
       '"constant", "heuristic" or "heuristic_transient"'),
    _F("assistant_confidence_threshold", 0.4, lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    _F("prompt_lookup_num_tokens", None, lambda v: is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("max_matching_ngram_size", None, lambda v: is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("assistant_early_exit", None, lambda v: is_int(v) and v >= 1, "a layer index >= 1 or None"),
    _F("assistant_lookbehind", 10, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    _F("target_lookbehind", 10, lambda v: is_int(v) and v >= 1, "an int >= 1"),
    _F("assistant_ensemble_weight", None, lambda v: is_num(v) and 0 < v < 1, "a number in (0, 1) or None"),
    _F("speculation_type", None),
    _F("candidate_generator", None, lambda v: isinstance(v, str) and bool(v),
       "the name of a registered candidate generator (see `genkit list`) or None",
       "Draft source for the assisted strategy, e.g. \"prompt_lookup\", \"draft_model\" or a pack's."),
    _F("candidate_generator_kwargs", None, lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
       "a dict of keyword arguments (str keys) for the candidate generator's factory, or None"),
)


# Fields transformers writes into generation_config.json that genkit cannot honour yet. A config
# may hold them (so such files load and save unchanged), but generate() refuses any value other than
# the ones listed as "off" with a NotSupportedError naming the field: none is accepted and ignored.


class _Tables:
    """The tables derived from the core fields and the registry's, made once per registry state
    (every request of a server reads them several times)."""

    def __init__(self, key: tuple[int, int], fields: dict[str, FieldSpec]) -> None:
        self.key, self.fields = key, fields
        self.defaults = {name: spec.default for name, spec in fields.items() if spec.default is not None}
        self.none_off = frozenset(name for name, spec in fields.items() if spec.off_when_none)
        self.token_ids = tuple((name, spec.token_ids) for name, spec in fields.items() if spec.token_ids is not None)


_tables: _Tables | None = None
_IMMUTABLE = (bool, int, float, str, bytes, type(None))


def _current() -> _Tables:
    global _tables
    registry = get_registry()
    key = (registry.serial, registry.version)
    tables = _tables
    if tables is None or tables.key != key:
        table = {f.name: f for f in CORE_FIELDS}
        for name, (spec, _origin) in registry.fields.items():
            table[name] = spec
        tables = _tables = _Tables(key, table)
    return tables


def field_table() -> dict[str, FieldSpec]:
    """Every ``GenerationConfig`` field by name: the core fields and those plugins declare."""
    return dict(_current().fields)


def default_values() -> dict[str, Any]:
    """The global defaults: the value of each field that neither the call nor the model's
    generation config sets (transformers' ``_get_default_generation_params``, plus the defaults of
    the fields plugins declare)."""
    return {name: copied(value) for name, value in _current().defaults.items()}


def token_id_fields() -> tuple[tuple[str, Callable[[Any], Iterable[Any]]], ...]:
    """``(name, ids of a value)`` of each field that holds token ids (``FieldSpec.token_ids``)."""
    return _current().token_ids


def copied(value: Any) -> Any:
    """A deep copy of a field's value; scalars and strings, which cannot change, as they are."""
    return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)


def none_means_off() -> frozenset[str]:
    """Fields for which an explicit ``None`` passed to ``generate`` turns a processor off, as in
    transformers 5 (``top_k=None`` samples without top-k; the default would be 50): those declared
    with ``FieldSpec(off_when_none=True)``. Every other field's ``None`` means its default."""
    return _current().none_off


def unknown_key_error(key: str, known: Any, what: str = "GenerationConfig field") -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"`{key}` is not a {what}.{hint}")


_ID_SUFFIXES = ("_token_id", "_token_ids")


def close_field(key: str, table: Iterable[str]) -> str | None:
    """The field ``key`` looks like a misspelling of, or ``None``.

    A key naming a token id (``*_token_id``) is matched on what precedes the suffix: a model's own
    special tokens in published files (Whisper's ``prev_sot_token_id``, Baichuan's
    ``user_token_id``, ``sep_token_id``, ``image_token_id``) are other tokens, not a misspelt
    ``eos_token_id`` / ``pad_token_id``; ``decoder_strat_token_id`` or ``eos_token_ids`` still are."""
    names = list(table)
    suffix = next((s for s in _ID_SUFFIXES if key.endswith(s) and len(key) > len(s)), None)
    if suffix is None:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
        return close[0] if close else None
    ids = {n[: -len("_token_id")]: n for n in names if n.endswith("_token_id")}
    close = difflib.get_close_matches(key[: -len(suffix)], list(ids), n=1, cutoff=0.75)
    return ids[close[0]] if close else None

