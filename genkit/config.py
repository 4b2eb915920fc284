"""``GenerationConfig``: every knob of a generation, read from and written to transformers'
``generation_config.json``, with transformers 5's semantics.

- Every field defaults to ``None``, meaning "not set": at generate time the model's
  ``generation_config`` fills what the call leaves unset, then the global defaults
  (:func:`default_values`, transformers' ``_get_default_generation_params``) fill the rest.
- The legal fields are the core fields below plus the fields registered plugins declare
  (``FieldSpec``), so a pack can add a knob. Other keys are kept as custom entries (and written
  back on save), with a "did you mean" warning when one is close to a field.
- Warnings about flags that have no effect know where each value came from: they are about what
  the caller set, and each is logged once per process.

This module does not import torch.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

from .errors import ConfigError, NotSupportedError
from .generation_mode import GenerationMode, mode_of_strategy
from .plugins import FieldSpec, get_registry

logger = logging.getLogger("genkit.config")

GENERATION_CONFIG_NAME = "generation_config.json"
# metadata transformers writes next to the settings: kept as read and written back
_METADATA = ("transformers_version", "_from_model_config")
# metadata transformers once wrote and no longer reads
_DROPPED_METADATA = ("_commit_hash", "_original_object_hash")
# generate() arguments; a config holding one is an error (as in transformers)
_GENERATE_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                       "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask")
# the cache implementations transformers accepts
_CACHE_IMPLEMENTATIONS = ("dynamic", "static", "offloaded", "offloaded_static", "quantized", "sliding_window",
                          "hybrid", "hybrid_chunked", "offloaded_hybrid", "offloaded_hybrid_chunked", "paged")
_EXTRA_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _token_id(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _token_ids(v: Any) -> bool:
    """One id or a non-empty list of ids."""
    if _token_id(v):
        return True
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_token_id(x) for x in v)


def _str_or_strs(v: Any) -> bool:
    if isinstance(v, str):
        return len(v) > 0
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(s, str) and s for s in v)


def _F(name: str, default: Any, check: Any = None, accepted: str = "", doc: str = "", coerce: Any = None) -> FieldSpec:
    return FieldSpec(name, default, check, accepted, doc, coerce)


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


def _watermarking_config(v: Any) -> bool:
    from .watermarking import is_watermarking_config

    return is_watermarking_config(v)


def _as_watermarking_config(v: Any) -> Any:
    from .watermarking import as_watermarking_config

    return as_watermarking_config(v)


def _compile_config(v: Any) -> bool:
    from .compile_config import CompileConfig

    return isinstance(v, CompileConfig)


def _as_compile_config(v: Any) -> Any:
    from .compile_config import as_compile_config

    return as_compile_config(v)


# Fields the core owns, with their global defaults (the value generate uses when neither the call
# nor the model's generation config sets one). Processor fields (temperature, top_k, ...) are
# declared by the built-in processors in ``builtin_strategies.fields`` through the registry, like a
# pack's fields.
CORE_FIELDS: tuple[FieldSpec, ...] = (
    # length
    _F("max_length", 20, lambda v: _is_int(v) and v >= 1, "an int >= 1",
       "Maximum total length (prompt + new tokens); overridden by max_new_tokens."),
    _F("max_new_tokens", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None",
       "Maximum number of tokens to generate, ignoring the prompt."),
    _F("min_length", 0, lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    _F("min_new_tokens", None, lambda v: _is_int(v) and v >= 0, "an int >= 0 or None"),
    _F("early_stopping", False, lambda v: v in (True, False, "never"), 'True, False or "never"'),
    _F("max_time", None, lambda v: _is_num(v) and v > 0, "a number of seconds > 0 or None"),
    _F("stop_strings", None, _str_or_strs, "a non-empty string or list of non-empty strings"),
    # strategy
    _F("do_sample", False, _is_bool, "True or False"),
    _F("num_beams", 1, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    _F("num_beam_groups", 1, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    _F("diversity_penalty", 0.0, lambda v: _is_num(v) and v >= 0, "a number >= 0"),
    _F("length_penalty", 1.0, _is_num, "a number (exponent on the sequence length)"),
    _F("penalty_alpha", None, lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1] or None"),
    _F("dola_layers", None, lambda v: v in ("low", "high") or (isinstance(v, list) and all(_is_int(x) for x in v)),
       '"low", "high", a list of layer indices, or None'),
    _F("force_words_ids", None, lambda v: isinstance(v, list) and len(v) > 0, "a non-empty list or None"),
    _F("constraints", None, _constraint_list, "a list of constraints (each a phrase or a disjunctive set "
       "as in force_words_ids, or an object with `token_ids` such as transformers 4's PhrasalConstraint and "
       "DisjunctiveConstraint) or None", coerce=_as_constraint_list),
    _F("use_cache", True, _is_bool, "True or False"),
    _F("cache_implementation", None, lambda v: v in _CACHE_IMPLEMENTATIONS,
       ", ".join(f'"{v}"' for v in _CACHE_IMPLEMENTATIONS) + " or None"),
    _F("cache_config", None),
    _F("max_cache_len", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("use_mtp", None),
    _F("compile_config", None, _compile_config, "a genkit.CompileConfig (or a dict of its keys) or None; it has "
       "no effect in genkit", coerce=_as_compile_config),
    _F("disable_compile", None),
    _F("continuous_batching_config", None, lambda v: isinstance(v, dict) or callable(getattr(v, "to_dict", None)),
       "a genkit.ContinuousBatchingConfig, a dict of its keys, or None"),
    _F("low_memory", None, _is_bool, "True, False or None"),
    _F("prefill_chunk_size", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("token_healing", False, _is_bool, "True or False"),
    _F("guidance_scale", None, lambda v: _is_num(v) and 0 <= v < float("inf"),
       "a finite number >= 0 (1 turns classifier-free guidance off) or None"),
    _F("watermarking_config", None, _watermarking_config,
       "a genkit.WatermarkingConfig, a dict of its keys, or another watermark config object "
       "(construct_processor, to_dict, validate), or None", coerce=_as_watermarking_config),
    _F("num_return_sequences", 1, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    # outputs
    _F("output_attentions", False, _is_bool, "True or False"),
    _F("output_hidden_states", False, _is_bool, "True or False"),
    _F("output_scores", False, _is_bool, "True or False"),
    _F("output_logits", None, lambda v: _is_bool(v), "True, False or None"),
    _F("return_dict_in_generate", False, _is_bool, "True or False"),
    # special tokens
    _F("pad_token_id", None, _token_id, "a token id >= 0 or None"),
    _F("bos_token_id", None, _token_id, "a token id >= 0 or None"),
    _F("eos_token_id", None, _token_ids, "a token id >= 0, a non-empty list of ids, or None"),
    _F("decoder_start_token_id", None, _token_ids, "a token id >= 0 or None"),
    # assisted decoding
    _F("is_assistant", False, _is_bool, "True or False"),
    _F("num_assistant_tokens", 20, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    _F("num_assistant_tokens_schedule", "constant", lambda v: v in ("constant", "heuristic", "heuristic_transient"),
       '"constant", "heuristic" or "heuristic_transient"'),
    _F("assistant_confidence_threshold", 0.4, lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    _F("prompt_lookup_num_tokens", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("max_matching_ngram_size", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("assistant_early_exit", None, lambda v: _is_int(v) and v >= 1, "a layer index >= 1 or None"),
    _F("assistant_lookbehind", 10, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    _F("target_lookbehind", 10, lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    _F("assistant_ensemble_weight", None, lambda v: _is_num(v) and 0 < v < 1, "a number in (0, 1) or None"),
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
# One line per field, naming what implements it; a feature that lands deletes its lines.
NOT_SUPPORTED: dict[str, str] = {
    "cache_config": "quantized or offloaded caches (no issue yet); leave it unset, genkit preallocates its cache",
    "use_mtp": "multi-token-prediction heads (no issue yet); use assistant_model= or prompt_lookup_num_tokens=",
    "token_healing": "token healing (no issue yet)",
    "output_attentions": "attention weights in the output (no issue yet; genkit's attention kernels do not "
                         "materialise them); output_hidden_states=True works",
    "assistant_ensemble_weight": "lossy ensembles of target and assistant logits (no issue yet); genkit's "
                                 "assisted decoding is lossless",
    "speculation_type": "speculation types (no issue yet); pick a draft source with candidate_generator=",
}

# values of a field that genkit cannot honour yet although the field itself works
_NOT_SUPPORTED_VALUES: dict[str, dict[Any, str]] = {
    "cache_implementation": {"quantized": "a quantized KV cache (no issue yet)"},
}

# values of those fields that mean "off" (besides the field's default)
_OFF_VALUES: dict[str, tuple[Any, ...]] = {}

# Fields accepted with no effect on what genkit generates (documented in docs/api.md, "Fields"):
# (cache_implementation: every value but "quantized", see _NOT_SUPPORTED_VALUES; "paged" switches
# generate to continuous batching, genkit/continuous/paged_generate.py)
# genkit's cache is always preallocated for max_length, generate does not compile, models are
# decoder-only, and is_assistant only marks a model as someone's assistant.
NO_EFFECT: dict[str, str] = {
    "cache_implementation": "genkit's cache is always preallocated for the whole generation; the output is the same",
    "max_cache_len": "the cache is sized for max_length",
    "compile_config": "generate does not torch.compile the model",
    "disable_compile": "generate does not torch.compile the model",
    "decoder_start_token_id": "encoder-decoder models only; genkit's models are decoder-only",
    "is_assistant": "a marker transformers sets on assistant models",
    "continuous_batching_config": "configures generate_batch and init_continuous_batching (docs/continuous_batching.md); "
                                  "generate runs without it",
    "prefill_chunk_size": "the prompt chunk of generate_batch and init_continuous_batching; generate computes a "
                          "prompt in one pass",
}


def unsupported_fields(config: Any) -> dict[str, Any]:
    """The fields of :data:`NOT_SUPPORTED` that ``config`` sets to something other than "off".

    A field a registered plugin declares (``FieldSpec``) is implemented by that plugin, so it is
    never reported here."""
    declared = get_registry().fields
    table = _field_table()
    out = {}
    for name in NOT_SUPPORTED:
        if name in declared:
            continue
        value = getattr(config, name, None)
        spec = table.get(name)
        default = spec.default if spec is not None else None
        if value is None or value == default or value in _OFF_VALUES.get(name, ()):
            continue
        out[name] = value
    for name, values in _NOT_SUPPORTED_VALUES.items():
        value = getattr(config, name, None)
        if name not in declared and isinstance(value, str) and value in values:
            out[name] = value
    return out


def check_supported(config: Any) -> None:
    """Raise :class:`~genkit.errors.NotSupportedError` naming every field set that genkit cannot honour yet."""
    found = unsupported_fields(config)
    if found:
        parts = [f"`{k}`={v!r} ({NOT_SUPPORTED[k] if k in NOT_SUPPORTED else _NOT_SUPPORTED_VALUES[k][v]})"
                 for k, v in found.items()]
        raise NotSupportedError("not supported by genkit yet: " + "; ".join(parts) + ". Leave these fields unset "
                                "(genkit never ignores a setting silently); see docs/api.md, 'Fields'.")


def _field_table() -> dict[str, FieldSpec]:
    table = {f.name: f for f in CORE_FIELDS}
    for name, (spec, _origin) in get_registry().fields.items():
        table[name] = spec
    return table


def default_values() -> dict[str, Any]:
    """The global defaults: the value of each field that neither the call nor the model's
    generation config sets (transformers' ``_get_default_generation_params``, plus the defaults of
    the fields plugins declare)."""
    return {name: copy.deepcopy(spec.default) for name, spec in _field_table().items() if spec.default is not None}


def _none_means_off() -> frozenset[str]:
    """Fields for which an explicit ``None`` passed to ``generate`` turns a processor off, as in
    transformers 5 (``top_k=None`` samples without top-k; the default would be 50). Every other
    field's ``None`` means its default."""
    from .builtin_strategies.fields import ALL

    return frozenset(spec.name for spec in ALL)


def unknown_key_error(key: str, known: Any, what: str = "GenerationConfig field") -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"`{key}` is not a {what}.{hint}")


# -- warnings, each logged once per process (transformers' warning_once) ----------------------------
_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it comes up in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _close_field(key: str, table: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.75)
    return close[0] if close else None


def _should_warn(outer: str, inner: str, user_set: set[str] | None) -> bool:
    """Warn about ``inner`` (e.g. ``top_p``) having no effect because of ``outer`` (e.g.
    ``do_sample``) unless the caller set ``outer`` and ``inner`` came from somewhere else (the
    model's generation config): a model's sampling defaults are harmless when the caller asks for
    greedy decoding. ``user_set=None`` counts everything as set by the caller."""
    if user_set is None:
        return True
    return not (outer in user_set and inner not in user_set)


class GenerationConfig:
    """Holds the parameters of a generation; compatible with transformers 5's ``GenerationConfig``.

    Every field is ``None`` until set ("use the default"); see docs/api.md, "GenerationConfig".
    """

    def __init__(self, **kwargs: Any) -> None:
        table = _field_table()
        user_set = {k for k in kwargs if k in table}
        d = self.__dict__
        for name in table:
            d[name] = None
        d["transformers_version"] = kwargs.pop("transformers_version", None)
        d["_from_model_config"] = kwargs.pop("_from_model_config", None)
        d["_loaded_hash"] = None
        for key in _DROPPED_METADATA:
            kwargs.pop(key, None)
        for key, value in kwargs.items():
            if key in table:
                d[key] = _coerced(table[key], value)
            elif not self._from_model_config:  # a model config's other attributes are no generation entries
                self._set_custom(key, value, table)
        self.validate(user_set_attributes=user_set)

    # -- attributes: fields, metadata and custom entries ---------------------------------------
    def __setattr__(self, key: str, value: Any) -> None:
        if not key.startswith("_") and key != "transformers_version" and key not in self.__dict__:
            table = _field_table()
            if key not in table:
                self._set_custom(key, value, table)
                return
        if not key.startswith("_"):
            spec = _field_table().get(key)
            if spec is not None:
                value = _coerced(spec, value)
        object.__setattr__(self, key, value)

    def __getattr__(self, key: str) -> Any:
        # a field declared by a plugin registered after this config was made: not set
        if not key.startswith("_") and key in _field_table():
            return None
        raise AttributeError(key)

    def _set_custom(self, key: str, value: Any, table: dict[str, FieldSpec]) -> None:
        """Keep ``key`` as a custom entry (written back on save, never read by generate), as
        transformers does; warn when it looks like a misspelt field."""
        close = _close_field(key, table)
        if close is not None:
            warn_once(f"`{key}` is not a GenerationConfig field; it is kept as a custom entry (saved with the "
                      f"config, never read by generate). Did you mean `{close}`?")
        object.__setattr__(self, key, value)

    def custom_entries(self) -> dict[str, Any]:
        """The entries that are no field (kept from a file or set by the caller), by name."""
        table = _field_table()
        return {k: v for k, v in self.__dict__.items()
                if not k.startswith("_") and k != "transformers_version" and k not in table}

    def _set_fields(self) -> set[str]:
        return {name for name in _field_table() if getattr(self, name) is not None}

    # -- dict / json ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (``None`` when not set), the custom entries and the metadata."""
        out = {name: copy.deepcopy(getattr(self, name)) for name in _field_table()}
        out.update(copy.deepcopy(self.custom_entries()))
        for key in _METADATA:
            out[key] = getattr(self, key)
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        """What differs from ``GenerationConfig()``: the fields set, the custom entries and the
        metadata read with the config (what ``save_pretrained`` writes)."""
        out = {name: copy.deepcopy(value) for name in _field_table() if (value := getattr(self, name)) is not None}
        out.update(copy.deepcopy(self.custom_entries()))
        for key in _METADATA:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def to_json_string(self, use_diff: bool = True, ignore_metadata: bool = False,
                       keys_to_pop: Iterable[str] | None = None) -> str:
        """JSON as transformers writes it (sorted keys, two-space indent, a final newline)."""
        data = self.to_diff_dict() if use_diff else self.to_dict()
        for key in list(keys_to_pop or ()) + (list(_METADATA) if ignore_metadata else []):
            data.pop(key, None)
        return json.dumps(_jsonable(data), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike[str], use_diff: bool = True,
                     keys_to_pop: Iterable[str] | None = None) -> None:
        from .fileutil import atomic_write_text

        atomic_write_text(json_file_path, self.to_json_string(use_diff=use_diff, keys_to_pop=keys_to_pop))

    def __repr__(self) -> str:
        return f"GenerationConfig {self.to_json_string(ignore_metadata=True)}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationConfig):
            return False
        return self.to_json_string(use_diff=False, ignore_metadata=True) == other.to_json_string(
            use_diff=False, ignore_metadata=True)

    def __hash__(self) -> int:
        return hash(self.to_json_string(ignore_metadata=True))

    def copy(self) -> GenerationConfig:
        return copy.deepcopy(self)

    # -- update / validate ----------------------------------------------------------------
    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Set the fields in ``kwargs``, validate, and return the entries that were not used.

        ``defaults_only=True`` sets only fields that are not set yet (``None``); the others are
        returned as unused. ``allow_custom_entries=True`` keeps keys that are no field as custom
        entries instead of returning them. Warnings only concern the fields set by this call."""
        used = self._apply(kwargs, defaults_only=defaults_only, allow_custom_entries=allow_custom_entries)
        self.validate(user_set_attributes=used)
        return {k: v for k, v in kwargs.items() if k not in used}

    def _apply(self, kwargs: dict[str, Any], *, defaults_only: bool = False,
               allow_custom_entries: bool = False) -> set[str]:
        table = _field_table()
        custom = self.custom_entries()
        used = set()
        for key, value in kwargs.items():
            if key in table or key in custom:
                if not defaults_only or getattr(self, key) is None:
                    object.__setattr__(self, key, _coerced(table[key], value) if key in table else value)
                    used.add(key)
            elif allow_custom_entries and not key.startswith("_") and key not in _METADATA:
                self._set_custom(key, value, table)
                used.add(key)
        return used

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        """Raise ``ValueError`` (a :class:`~genkit.errors.ConfigError`) for an invalid value or
        combination.

        Flags that have no effect (a sampling knob while ``do_sample`` is not ``True``, an output
        flag without ``return_dict_in_generate``) are logged once, or raised when ``strict=True``.
        ``user_set_attributes`` names the fields the caller set: a flag inherited from a model's
        generation config is not warned about when the caller set the flag that disables it
        (``None``: everything counts as set by the caller)."""
        table = _field_table()
        for name, spec in table.items():
            spec.validate(getattr(self, name))
        for arg in _GENERATE_ARGUMENTS:
            if arg in self.__dict__:
                raise ConfigError(f"`{arg}` is not a GenerationConfig entry; pass it to generate() directly.")
        _check_combinations(self)
        minor = _minor_issues(self, table, user_set_attributes)
        if not minor:
            return
        if strict:
            raise ConfigError("GenerationConfig is invalid:\n" + "\n".join(f"- {m}" for m in minor))
        for msg in minor:
            warn_once(msg)

    # -- strategy ---------------------------------------------------------------------------
    def strategy_name(self, assistant_model: Any = None) -> str:
        """Name of the registered strategy that ``generate`` runs for this config (defaults
        filled), as the registry answers (``genkit list``)."""
        config = self.with_defaults()
        if assistant_model is not None:
            object.__setattr__(config, "_assistant_model", assistant_model)
        return get_registry().select_strategy(config).name

    def get_generation_mode(self, assistant_model: Any = None) -> GenerationMode | str:
        """The :class:`~genkit.GenerationMode` of the strategy that runs (transformers' names:
        ``greedy_search``, ``sample``, ``assisted_generation``, ``beam_search``, ...). A strategy a
        pack registers with no transformers counterpart is reported by its registry name (a ``str``).
        The registry chooses; see ``genkit.generation_mode.STRATEGY_MODES`` for the mapping."""
        return mode_of_strategy(self.strategy_name(assistant_model))

    def with_defaults(self) -> GenerationConfig:
        """A copy with every unset field at its global default (what generate runs with when the
        model's generation config sets nothing)."""
        config = self.copy()
        config._fill_defaults()
        return config

    def _fill_defaults(self, keep_none: Iterable[str] = ()) -> set[str]:
        """Set every unset field (except those in ``keep_none``) to its default; return their names."""
        keep = set(keep_none)
        filled = set()
        for name, value in default_values().items():
            if getattr(self, name) is None and name not in keep:
                object.__setattr__(self, name, value)
                filled.add(name)
        return filled

    @staticmethod
    def _get_default_generation_params() -> dict[str, Any]:
        """transformers' name for :func:`default_values`."""
        return default_values()

    # -- files ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        """Build from ``config_dict`` (its unknown keys become custom entries), then set the fields
        in ``kwargs``. Keyword arguments that are no field are not used: returned with
        ``return_unused_kwargs=True``, otherwise ignored (logged; a warning when close to a field)."""
        for key in ("_from_auto", "_from_pipeline"):
            kwargs.pop(key, None)
        config = cls(**config_dict)
        unused = config.update(**kwargs)
        _log_unused(unused)
        config._loaded_hash = hash(config)
        if return_unused_kwargs:
            return config, unused
        return config

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> GenerationConfig:
        from .config_files import read_config_json

        return cls.from_dict(read_config_json(path))  # type: ignore[no-any-return]

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name: str | os.PathLike[str],
        config_file_name: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        token: str | bool | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load ``generation_config.json`` (or ``config_file_name``; ``config_name=`` is accepted as
        an alias) from a folder, a json file or a Hub repo, then apply the field ``kwargs`` as
        overrides. Loader options as in transformers: ``subfolder``, ``proxies``,
        ``local_files_only``, ``return_unused_kwargs``; other keyword arguments that are no field are
        ignored (returned with ``return_unused_kwargs=True``)."""
        from .config_files import resolve_config_file

        alias = kwargs.pop("config_name", None)
        if alias is not None:
            if config_file_name is not None and os.fspath(config_file_name) != os.fspath(alias):
                raise ConfigError("pass the file name once: `config_file_name` or its alias `config_name`, not both")
            config_file_name = alias
        return_unused_kwargs = bool(kwargs.pop("return_unused_kwargs", False))
        path, kwargs = resolve_config_file(
            pretrained_model_name, config_file_name or GENERATION_CONFIG_NAME, cache_dir=cache_dir,
            force_download=force_download, local_files_only=local_files_only, token=token, revision=revision,
            **kwargs)
        from .config_files import read_config_json

        data = read_config_json(path)
        if kwargs.pop("_from_model_config", False):
            return cls.from_model_config(data)
        return cls.from_dict(data, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        config_file_name: str | os.PathLike[str] | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> str:
        """Write ``generation_config.json`` (atomically) and return its path; with
        ``push_to_hub=True`` also upload it to ``repo_id=`` (default: the folder's name, in your
        namespace).

        A config changed since it was loaded (or built in code) is validated strictly: a flag that
        would have no effect is an error and nothing is written, as in transformers. A config saved
        unchanged is only warned about, so published configs can always be saved back."""
        was_modified = self._loaded_hash != hash(self)
        try:
            self.validate(strict=was_modified)
        except ValueError as exc:
            raise ConfigError(f"{exc}\n\nFix these issues to save the configuration.") from exc
        directory = os.fspath(save_directory)
        if os.path.isfile(directory):
            raise ConfigError(f"`save_directory` must be a folder; {directory!r} is a file")
        name = os.fspath(config_file_name) if config_file_name is not None else GENERATION_CONFIG_NAME
        path = os.path.join(directory, name)
        os.makedirs(directory, exist_ok=True)
        self.to_json_file(path, keys_to_pop=["compile_config"])
        logger.info("generation config saved in %s", path)
        if push_to_hub:
            from .config_files import push_config_file

            push_config_file(path, directory, **kwargs)
        elif kwargs:
            raise ConfigError(f"save_pretrained: {sorted(kwargs)} only apply with push_to_hub=True")
        return path

    @classmethod
    def from_model_config(cls, model_config: Any) -> GenerationConfig:
        """Build from a model config (a dict, a transformers config or genkit's ``ModelConfig``):
        the generation fields it holds (special token ids, ...), as transformers does. Values that
        are not valid for the field are left out."""
        if isinstance(model_config, dict):
            data = dict(model_config)
        elif callable(getattr(model_config, "to_dict", None)):
            data = model_config.to_dict()
        else:
            data = dict(vars(model_config))
        table = _field_table()
        kwargs = {k: v for k, v in data.items() if k in table and v is not None}
        config = cls(_from_model_config=True, **_valid_only(kwargs, table))
        # some models keep generation attributes in their decoder's config
        decoder = _decoder_config(model_config, data)
        if decoder:
            unset = {k: v for k, v in _valid_only(decoder, table).items() if getattr(config, k) is None}
            config._apply(unset)
        if not config.return_dict_in_generate and any(getattr(config, f) for f in _EXTRA_OUTPUT_FLAGS):
            config.return_dict_in_generate = True
        config._loaded_hash = hash(config)
        return config


def _valid_only(values: dict[str, Any], table: dict[str, FieldSpec]) -> dict[str, Any]:
    """The entries of ``values`` that are fields with a valid value (a model config carries
    attributes for other purposes too)."""
    good = {}
    for key, value in values.items():
        if key not in table or value is None:
            continue
        try:
            table[key].validate(value)
        except ValueError:
            continue
        good[key] = value
    return good


def _decoder_config(model_config: Any, data: dict[str, Any]) -> dict[str, Any]:
    get_text_config = getattr(model_config, "get_text_config", None)
    if callable(get_text_config):  # a transformers config
        text = get_text_config(decoder=True)
        return text.to_dict() if text is not model_config else {}  # type: ignore[no-any-return]
    for key in ("decoder", "generator", "text_config"):
        value = data.get(key)
        if isinstance(value, dict):
            return value
        if value is not None and callable(getattr(value, "to_dict", None)):
            return value.to_dict()  # type: ignore[no-any-return]
    return {}


def _log_unused(unused: dict[str, Any]) -> None:
    if not unused:
        return
    table = _field_table()
    for key in unused:
        close = _close_field(key, table)
        if close is not None:
            warn_once(f"`{key}` is not a GenerationConfig field and was ignored. Did you mean `{close}`?")
    logger.info("ignored keyword arguments that are no GenerationConfig field: %s", sorted(unused))


def _coerced(spec: FieldSpec, value: Any) -> Any:
    """``value`` as the field holds it (a field's ``coerce``, e.g. a dict to a WatermarkingConfig)."""
    if spec.coerce is None or value is None:
        return value
    return spec.coerce(value)


def _jsonable(v: Any) -> Any:
    if callable(getattr(v, "to_dict", None)) and not isinstance(v, (dict, list, tuple)):
        return _jsonable(v.to_dict())
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "to_dict") and callable(v.to_dict):  # a config object (e.g. a watermarking config)
        return _jsonable(v.to_dict())
    return v


def _value(c: GenerationConfig, name: str) -> Any:
    """The value generate would use: the field's, or its default when unset."""
    value = getattr(c, name)
    if value is None:
        spec = _field_table().get(name)
        return spec.default if spec is not None else None
    return value


def _check_combinations(c: GenerationConfig) -> None:
    v = lambda name: _value(c, name)  # noqa: E731
    if c.max_length is not None and c.min_length is not None and c.max_new_tokens is None \
            and c.min_length > c.max_length:
        raise ConfigError(f"`min_length` ({c.min_length}) must be <= `max_length` ({c.max_length}).")
    if c.max_new_tokens is not None and c.min_new_tokens is not None and c.min_new_tokens > c.max_new_tokens:
        raise ConfigError(
            f"`min_new_tokens` ({c.min_new_tokens}) must be <= `max_new_tokens` ({c.max_new_tokens})."
        )
    if v("do_sample") and _is_num(c.temperature) and c.temperature <= 0:
        raise ConfigError(
            f"`temperature` must be a number > 0 when do_sample=True; got {c.temperature!r}. "
            "For greedy decoding set do_sample=False."
        )
    beams, groups, returned = v("num_beams"), v("num_beam_groups"), v("num_return_sequences")
    if beams % groups != 0:
        raise ConfigError(f"`num_beams` ({beams}) must be divisible by `num_beam_groups` ({groups}).")
    if groups > 1 and v("do_sample"):
        raise ConfigError("`num_beam_groups` > 1 (diverse beam search) requires do_sample=False.")
    if beams > 1 and returned > beams:
        raise ConfigError(f"`num_return_sequences` ({returned}) must be <= `num_beams` ({beams}).")
    if beams == 1 and not v("do_sample") and returned > 1:
        raise ConfigError(
            f"`num_return_sequences` ({returned}) > 1 needs do_sample=True or num_beams > 1; "
            "greedy search returns one sequence per prompt."
        )
    for name in ("force_words_ids", "constraints"):
        if getattr(c, name) and (v("do_sample") or beams == 1):
            raise ConfigError(f"`{name}` (constrained beam search) needs num_beams > 1 and do_sample=False.")
    _check_forced_not_suppressed(c)
    _check_layer_strategies(c)


def _check_forced_not_suppressed(c: GenerationConfig) -> None:
    """A token both forced and suppressed gives all -inf logits, then NaN (transformers' check)."""
    suppressed = getattr(c, "suppress_tokens", None)
    if not suppressed:
        return
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(c, name, None)
        if forced is None:
            continue
        forced_set = {forced} if isinstance(forced, int) else set(forced)
        if forced_set and forced_set <= set(suppressed):
            raise ConfigError(
                f"every token in `{name}` ({sorted(forced_set)}) is also in `suppress_tokens`: forcing a token "
                f"while suppressing it leaves no token to generate. Remove it from one of the two (to prevent "
                "an early EOS, use `min_new_tokens`)."
            )




def _check_layer_strategies(c: GenerationConfig) -> None:
    """Contrastive search, DoLa and early exit: each needs its companion settings, and none of them
    combines with beams, with each other or with a draft source (one would be ignored)."""
    v = lambda name: _value(c, name)  # noqa: E731
    contrastive = c.penalty_alpha is not None and c.penalty_alpha > 0
    if contrastive and not (_is_int(v('top_k')) and v('top_k') > 1):
        raise ConfigError(f"`penalty_alpha` > 0 (contrastive search) needs `top_k` > 1 candidates per step; got "
                          f"top_k={v('top_k')!r}. Set top_k (e.g. 4), or penalty_alpha=None for greedy search.")
    if contrastive and (v('do_sample') or v('num_beams') != 1):
        raise ConfigError("`penalty_alpha` (contrastive search) is deterministic and single-beam: it needs "
                          f"do_sample=False and num_beams=1; got do_sample={v('do_sample')!r}, num_beams={v('num_beams')!r}.")
    if c.low_memory and not contrastive:
        raise ConfigError("`low_memory=True` only changes contrastive search (penalty_alpha > 0, top_k > 1); "
                          "accepted otherwise: False or None.")
    chosen = [name for name, on in (("penalty_alpha", contrastive), ("dola_layers", c.dola_layers is not None),
                                    ("assistant_early_exit", c.assistant_early_exit is not None)) if on]
    drafts = [n for n in ("prompt_lookup_num_tokens", "candidate_generator") if getattr(c, n) is not None]
    if len(chosen) > 1 or (chosen and drafts):
        raise ConfigError(f"{' and '.join(f'`{n}`' for n in chosen + drafts)} select different strategies; set one "
                          "of them.")
    if chosen and v('num_beams') != 1:
        raise ConfigError(f"`{chosen[0]}` works with num_beams=1; got num_beams={v('num_beams')!r}.")


_SAMPLING_FLAGS = (("temperature", 1.0), ("top_p", 1.0), ("min_p", None), ("top_h", None), ("typical_p", 1.0),
                   ("top_k", 50), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0))


def _minor_issues(c: GenerationConfig, table: dict[str, FieldSpec], user_set: set[str] | None) -> list[str]:
    """Flags that have no effect with the rest of the config (transformers 5's list, same
    provenance rule)."""
    issues = []
    if c.do_sample is not True:
        for name, off in _SAMPLING_FLAGS:
            value = getattr(c, name, None)
            if name == "top_k" and c.penalty_alpha:  # contrastive search's candidates per step
                continue
            if name in table and value is not None and value != off and _should_warn("do_sample", name, user_set):
                issues.append(f"`{name}` is set to {value!r} but `do_sample` is not True, so it has no effect "
                              f"(set do_sample=True or unset `{name}`).")
    if c.num_beams is None or c.num_beams == 1:
        for name, off in (("early_stopping", False), ("length_penalty", 1.0)):
            value = getattr(c, name)
            if value is not None and value != off and _should_warn("num_beams", name, user_set):
                issues.append(f"`{name}` is set to {value!r} but it only applies to beam search (num_beams > 1), "
                              "so it has no effect.")
    if (c.num_beam_groups is None or c.num_beam_groups == 1) and c.diversity_penalty not in (None, 0.0) \
            and _should_warn("num_beam_groups", "diversity_penalty", user_set):
        issues.append("`diversity_penalty` only applies to diverse beam search (num_beam_groups > 1), "
                      "so it has no effect.")
    if c.use_cache is False:
        for name in ("cache_implementation", "cache_config"):
            if getattr(c, name) is not None:
                issues.append(f"`{name}` is set but `use_cache` is False, so it has no effect.")
    if c.return_dict_in_generate is not True:
        for name in _EXTRA_OUTPUT_FLAGS:
            if getattr(c, name) is True:
                issues.append(f"`{name}` is True but `return_dict_in_generate` is not, so generate returns only "
                              f"the sequences and `{name}` has no effect.")
    return issues


# -- generate time ---------------------------------------------------------------------------------

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
        inherited = {k: v for k, v in model_config.to_dict().items() if k not in _METADATA}
        config._apply(copy.deepcopy(inherited), defaults_only=True, allow_custom_entries=True)
    defaulted = config._fill_defaults()
    table = _field_table()
    fields = {k: v for k, v in kwargs.items() if k in table}
    used = config._apply(fields)
    user_set |= used
    defaulted -= used
    defaulted |= config._fill_defaults(keep_none=_none_means_off())
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
