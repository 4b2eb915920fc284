"""``GenerationConfig``: every knob of a generation, read from and written to transformers'
``generation_config.json``.

The legal keys are the core fields below plus the fields that registered logits processors
declare (``FieldSpec``), so a pack can add a knob. An unknown key is an error that suggests the
closest known name. This module does not import torch.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
from numbers import Integral, Real
from typing import Any

from .errors import ConfigError
from .plugins import FieldSpec, get_registry

logger = logging.getLogger("genkit.config")

GENERATION_CONFIG_NAME = "generation_config.json"
# keys transformers writes that carry no generation setting
_META_KEYS = {"transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash"}


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


def _watermarking_config(v: Any) -> bool:
    from .watermarking import is_watermarking_config

    return is_watermarking_config(v)


def _as_watermarking_config(v: Any) -> Any:
    from .watermarking import as_watermarking_config

    return as_watermarking_config(v)


# Fields the core owns. Processor fields (temperature, top_k, ...) are declared by the built-in
# processors in ``builtin_strategies.fields`` through the registry, like a pack's fields.
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
    _F("constraints", None, lambda v: isinstance(v, list), "a list or None"),
    _F("use_cache", True, _is_bool, "True or False"),
    _F("cache_implementation", None, lambda v: v in ("dynamic", "static"), '"dynamic", "static" or None'),
    _F("cache_config", None),
    _F("max_cache_len", None, lambda v: _is_int(v) and v >= 1, "an int >= 1 or None"),
    _F("use_mtp", None),
    _F("compile_config", None),
    _F("disable_compile", None),
    _F("continuous_batching_config", None),
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
    _F("assistant_ensemble_weight", None),
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
    "continuous_batching_config": "continuous batching (issue 14)",
    "prefill_chunk_size": "chunked prefill, part of continuous batching (issue 14)",
    "cache_config": "quantized or offloaded caches",
    "use_mtp": "multi-token-prediction heads",
    "token_healing": "token healing",
    "output_attentions": "attention weights in the output (genkit's attention kernels do not materialise them)",
    "assistant_ensemble_weight": "ensembles of target and assistant logits",
    "speculation_type": "speculation types other than genkit's candidate generators",
}

# values of those fields that mean "off" (besides the field's default)
_OFF_VALUES: dict[str, tuple[Any, ...]] = {}

# Fields accepted with no effect on what genkit generates (documented in docs/api.md, "Fields"):
# genkit's cache is always preallocated for max_length, generate does not compile, models are
# decoder-only, and is_assistant only marks a model as someone's assistant.
NO_EFFECT: dict[str, str] = {
    "cache_implementation": "genkit's cache is always preallocated for the whole generation; the output is the same",
    "max_cache_len": "the cache is sized for max_length",
    "compile_config": "generate does not torch.compile the model",
    "disable_compile": "generate does not torch.compile the model",
    "decoder_start_token_id": "encoder-decoder models only; genkit's models are decoder-only",
    "is_assistant": "a marker transformers sets on assistant models",
}


def unsupported_fields(config: Any) -> dict[str, Any]:
    """The fields of :data:`NOT_SUPPORTED` that ``config`` sets to something other than "off"."""
    table = _field_table()
    out = {}
    for name in NOT_SUPPORTED:
        value = getattr(config, name, None)
        spec = table.get(name)
        default = spec.default if spec is not None else None
        if value is None or value == default or value in _OFF_VALUES.get(name, ()):
            continue
        out[name] = value
    return out


def check_supported(config: Any) -> None:
    """Raise :class:`~genkit.errors.NotSupportedError` naming every field set that genkit cannot honour yet."""
    from .errors import NotSupportedError

    found = unsupported_fields(config)
    if found:
        parts = [f"`{k}`={v!r} ({NOT_SUPPORTED[k]})" for k, v in found.items()]
        raise NotSupportedError("not supported by genkit yet: " + "; ".join(parts) + ". Leave these fields unset "
                                "(genkit never ignores a setting silently); see docs/api.md, 'Fields'.")


def _field_table() -> dict[str, FieldSpec]:
    table = {f.name: f for f in CORE_FIELDS}
    for name, (spec, _origin) in get_registry().fields.items():
        table[name] = spec
    return table


def unknown_key_error(key: str, known: Any, what: str = "GenerationConfig field") -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return ConfigError(f"`{key}` is not a {what}.{hint}")


class GenerationConfig:
    """Holds the parameters of a generation; compatible with transformers' ``GenerationConfig``."""

    def __init__(self, **kwargs: Any) -> None:
        table = _field_table()
        for name, spec in table.items():
            object.__setattr__(self, name, copy.deepcopy(spec.default))
        for key in _META_KEYS:
            kwargs.pop(key, None)
        for key, value in kwargs.items():
            if key not in table:
                raise unknown_key_error(key, table)
            setattr(self, key, value)
        self.validate()

    # -- attribute guard: a misspelt attribute assignment is an error, not a silent no-op -----
    def __setattr__(self, key: str, value: Any) -> None:
        if not key.startswith("_"):
            table = _field_table()
            if key not in table:
                raise unknown_key_error(key, table)
            value = _coerced(table[key], value)
        object.__setattr__(self, key, value)

    def __getattr__(self, key: str) -> Any:
        # fields declared by a plugin registered after this config was made
        if not key.startswith("_"):
            spec = _field_table().get(key)
            if spec is not None:
                return copy.deepcopy(spec.default)
        raise AttributeError(key)

    # -- dict / json ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {name: copy.deepcopy(getattr(self, name)) for name in _field_table()}

    def to_diff_dict(self) -> dict[str, Any]:
        """The fields whose value differs from the default."""
        out = {}
        for name, spec in _field_table().items():
            value = getattr(self, name)
            if value != spec.default:
                out[name] = copy.deepcopy(value)
        return out

    def to_json_string(self, use_diff: bool = True) -> str:
        data = self.to_diff_dict() if use_diff else self.to_dict()
        return json.dumps(_jsonable(data), indent=2, sort_keys=True) + "\n"

    def __repr__(self) -> str:
        return f"GenerationConfig {self.to_json_string()}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return self.to_diff_dict() == other.to_diff_dict()

    __hash__ = None  # type: ignore[assignment]

    def copy(self) -> GenerationConfig:
        return copy.deepcopy(self)

    # -- update / validate ----------------------------------------------------------------
    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the known keys, validate, and return the keys that are not config fields."""
        table = _field_table()
        unused = {k: v for k, v in kwargs.items() if k not in table}
        for key, value in kwargs.items():
            if key in table:
                object.__setattr__(self, key, _coerced(table[key], value))
        self.validate()
        return unused

    def validate(self, strict: bool = False) -> None:
        """Raise ``ValueError`` for an invalid value or combination.

        Minor issues (a sampling knob set while ``do_sample=False``) are logged, or raised when
        ``strict=True``.
        """
        table = _field_table()
        for name, spec in table.items():
            spec.validate(getattr(self, name))
        _check_combinations(self)
        minor = _minor_issues(self, table)
        if minor:
            if strict:
                raise ValueError("GenerationConfig has issues: " + " ".join(minor))
            for msg in minor:
                logger.warning(msg)

    # -- strategy ---------------------------------------------------------------------------
    def get_generation_mode(self, assistant_model: Any = None) -> str:
        """Name of the registered strategy that handles this config (answered by the registry)."""
        config = self
        if assistant_model is not None:
            config = self.copy()
            object.__setattr__(config, "_assistant_model", assistant_model)
        return get_registry().select_strategy(config).name

    # -- files ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        table = _field_table()
        data = {k: v for k, v in data.items() if k not in _META_KEYS}
        known = {k: v for k, v in data.items() if k in table and v is not None}
        ignored = {k: v for k, v in data.items() if k not in table}
        if ignored:
            logger.info("ignoring keys that genkit does not know: %s", sorted(ignored))
        config = cls(**known)
        unused = config.update(**kwargs)
        if return_unused_kwargs:
            return config, unused
        if unused:
            raise unknown_key_error(next(iter(unused)), table)
        return config

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> GenerationConfig:
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name: str | os.PathLike[str],
        config_file_name: str | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        force_download: bool = False,
        token: str | bool | None = None,
        subfolder: str = "",
        return_unused_kwargs: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Load from a folder, a json file, or a Hub repo, then apply ``kwargs`` as overrides."""
        name = config_file_name or GENERATION_CONFIG_NAME
        src = os.fspath(pretrained_model_name)
        if os.path.isfile(src):
            path = src
        elif os.path.isdir(src):
            path = os.path.join(src, subfolder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} not found")
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(src, name, revision=revision, cache_dir=cache_dir,
                                   force_download=force_download, token=token, subfolder=subfolder or None)
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return cls.from_dict(data, return_unused_kwargs=return_unused_kwargs, **kwargs)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        config_file_name: str | None = None,
        push_to_hub: bool = False,
        **hub_kwargs: Any,
    ) -> str:
        """Write ``generation_config.json`` atomically; optionally upload it (``repo_id=``)."""
        self.validate()
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(os.fspath(save_directory), config_file_name or GENERATION_CONFIG_NAME)
        from .fileutil import atomic_write_text

        atomic_write_text(path, self.to_json_string())
        if push_to_hub:
            from huggingface_hub import HfApi

            repo_id = hub_kwargs.pop("repo_id", None)
            if not repo_id:
                raise ValueError("`repo_id` is required with push_to_hub=True")
            api = HfApi(token=hub_kwargs.pop("token", None))
            api.create_repo(repo_id, exist_ok=True, private=hub_kwargs.pop("private", None))
            api.upload_file(path_or_fileobj=path, path_in_repo=os.path.basename(path), repo_id=repo_id,
                            commit_message=hub_kwargs.pop("commit_message", "Upload generation config"))
        return path

    @classmethod
    def from_model_config(cls, model_config: Any) -> GenerationConfig:
        """Build from a model config (dict or object): special token ids and generation fields."""
        data = model_config if isinstance(model_config, dict) else dict(vars(model_config))
        table = _field_table()
        kwargs = {k: v for k, v in data.items() if k in table and v is not None and k not in _META_KEYS}
        # a model config carries fields for other purposes too; keep only valid generation values
        good = {}
        for k, v in kwargs.items():
            try:
                table[k].validate(v)
            except ValueError:
                continue
            good[k] = v
        return cls(**good)


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
    return v


def _check_combinations(c: GenerationConfig) -> None:
    if c.max_new_tokens is None and c.min_length > c.max_length:
        raise ValueError(
            f"`min_length` ({c.min_length}) must be <= `max_length` ({c.max_length})."
        )
    if c.max_new_tokens is not None and c.min_new_tokens is not None and c.min_new_tokens > c.max_new_tokens:
        raise ValueError(
            f"`min_new_tokens` ({c.min_new_tokens}) must be <= `max_new_tokens` ({c.max_new_tokens})."
        )
    if c.do_sample and _is_num(c.temperature) and c.temperature <= 0:
        raise ValueError(
            f"`temperature` must be a number > 0 when do_sample=True; got {c.temperature!r}. "
            "For greedy decoding set do_sample=False."
        )
    if c.num_beams % c.num_beam_groups != 0:
        raise ValueError(
            f"`num_beams` ({c.num_beams}) must be divisible by `num_beam_groups` ({c.num_beam_groups})."
        )
    if c.num_beam_groups > 1 and c.do_sample:
        raise ValueError("`num_beam_groups` > 1 (diverse beam search) requires do_sample=False.")
    if c.num_beams > 1 and c.num_return_sequences > c.num_beams:
        raise ValueError(
            f"`num_return_sequences` ({c.num_return_sequences}) must be <= `num_beams` ({c.num_beams})."
        )
    if c.num_beams == 1 and not c.do_sample and c.num_return_sequences > 1:
        raise ValueError(
            f"`num_return_sequences` ({c.num_return_sequences}) > 1 needs do_sample=True or num_beams > 1; "
            "greedy search returns one sequence per prompt."
        )
    if c.force_words_ids is not None and (c.do_sample or c.num_beams == 1):
        raise ValueError("`force_words_ids` (constrained beam search) needs num_beams > 1 and do_sample=False.")
    _check_layer_strategies(c)
    if c.early_stopping not in (True, False, "never"):
        raise ValueError(f'`early_stopping` must be True, False or "never"; got {c.early_stopping!r}.')


def _check_layer_strategies(c: GenerationConfig) -> None:
    """Contrastive search, DoLa and early exit: each needs its companion settings, and none of them
    combines with beams, with each other or with a draft source (one would be ignored)."""
    contrastive = c.penalty_alpha is not None and c.penalty_alpha > 0
    if contrastive and not (_is_int(c.top_k) and c.top_k > 1):
        raise ConfigError(f"`penalty_alpha` > 0 (contrastive search) needs `top_k` > 1 candidates per step; got "
                          f"top_k={c.top_k!r}. Set top_k (e.g. 4), or penalty_alpha=None for greedy search.")
    if contrastive and (c.do_sample or c.num_beams != 1):
        raise ConfigError("`penalty_alpha` (contrastive search) is deterministic and single-beam: it needs "
                          f"do_sample=False and num_beams=1; got do_sample={c.do_sample!r}, num_beams={c.num_beams!r}.")
    if c.low_memory and not contrastive:
        raise ConfigError("`low_memory=True` only changes contrastive search (penalty_alpha > 0, top_k > 1); "
                          "accepted otherwise: False or None.")
    chosen = [name for name, on in (("penalty_alpha", contrastive), ("dola_layers", c.dola_layers is not None),
                                    ("assistant_early_exit", c.assistant_early_exit is not None)) if on]
    drafts = [n for n in ("prompt_lookup_num_tokens", "candidate_generator") if getattr(c, n) is not None]
    if len(chosen) > 1 or (chosen and drafts):
        raise ConfigError(f"{' and '.join(f'`{n}`' for n in chosen + drafts)} select different strategies; set one "
                          "of them.")
    if chosen and c.num_beams != 1:
        raise ConfigError(f"`{chosen[0]}` works with num_beams=1; got num_beams={c.num_beams!r}.")


def _minor_issues(c: GenerationConfig, table: dict[str, FieldSpec]) -> list[str]:
    issues = []
    if not c.do_sample:
        for name in ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"):
            spec = table.get(name)
            if spec is not None and getattr(c, name) != spec.default:
                issues.append(f"`{name}` is set to {getattr(c, name)!r} but do_sample=False, so it has no effect.")
    if c.num_beams == 1:
        if c.length_penalty != 1.0:
            issues.append("`length_penalty` only applies to beam search (num_beams > 1).")
        if c.early_stopping is not False:
            issues.append("`early_stopping` only applies to beam search (num_beams > 1).")
    if c.num_beam_groups == 1 and c.diversity_penalty != 0.0:
        issues.append("`diversity_penalty` only applies to diverse beam search (num_beam_groups > 1).")
    return issues
