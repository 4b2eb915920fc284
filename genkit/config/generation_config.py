"""``GenerationConfig``: every knob of a generation, read from and written to transformers'
``generation_config.json``, with transformers 5's semantics.

- Every field defaults to ``None``, meaning "not set": at generate time the model's
  ``generation_config`` fills what the call leaves unset, then the global defaults
  (:func:`~genkit.config.fields.default_values`) fill the rest (``genkit.config.resolve``).
- Keys that are no field are kept as custom entries (and written back on save), with a "did you
  mean" warning when one is close to a field.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError, FrozenConfigError
from ..generation_mode import GenerationMode, mode_of_strategy
from ..plugins import FieldSpec, get_registry
from .checks import check_combinations, minor_issues
from .fields import (
    DROPPED_METADATA,
    EXTRA_OUTPUT_FLAGS,
    GENERATE_ARGUMENTS,
    GENERATION_CONFIG_NAME,
    METADATA,
    close_field,
    copied,
    default_values,
    field_table,
    negative_id,
    past_int64,
    token_ids_in,
    unknown_key_error,
)
from .files import push_config_file, read_config_json, resolve_config_file
from .warn import logger, warn_once


@contextmanager
def _naming_file(path: str | os.PathLike[str]) -> Iterator[None]:
    """A ``ConfigError`` raised in the block names the file whose values it is about."""
    try:
        yield
    except ConfigError as exc:
        raise type(exc)(f"{os.fspath(path)}: {exc}") from exc  # its kind kept (NotSupportedError, ...)


def _file_name(config_file_name: str | os.PathLike[str] | None,
               kwargs: dict[str, Any]) -> str | os.PathLike[str] | None:
    """``config_file_name``, or its alias ``config_name`` popped from ``kwargs`` (not both, unless equal)."""
    alias = kwargs.pop("config_name", None)
    if alias is None:
        return config_file_name
    if config_file_name is not None and os.fspath(config_file_name) != os.fspath(alias):
        raise ConfigError("pass the file name once: `config_file_name` or its alias `config_name`, not both")
    return alias


class GenerationConfig:
    """Holds the parameters of a generation; compatible with transformers 5's ``GenerationConfig``.

    Every field is ``None`` until set ("use the default"); see docs/api.md, "GenerationConfig".
    """

    def __init__(self, **kwargs: Any) -> None:
        table = field_table()
        user_set = {k for k in kwargs if k in table}
        d = self.__dict__
        for name in table:
            d[name] = None
        d["transformers_version"] = kwargs.pop("transformers_version", None)
        d["_from_model_config"] = kwargs.pop("_from_model_config", None)
        d["_loaded_hash"] = None
        for key in DROPPED_METADATA:
            kwargs.pop(key, None)
        for key, value in kwargs.items():
            if key in table:
                d[key] = _coerced(table[key], value)
            elif not self._from_model_config:  # a model config's other attributes are no generation entries
                self._set_custom(key, value, table)
        if kwargs:  # a config that sets nothing is valid (generate makes one per call: no checks to pay)
            self.validate(user_set_attributes=user_set)

    # -- attributes: fields, metadata and custom entries ---------------------------------------
    def __setattr__(self, key: str, value: Any) -> None:
        if not key.startswith("_") and key != "transformers_version" and key not in self.__dict__:
            table = field_table()
            if key not in table:
                self._set_custom(key, value, table)
                return
        if not key.startswith("_"):
            spec = field_table().get(key)
            if spec is not None:
                value = _coerced(spec, value)
        self._store(key, value)

    def _store(self, key: str, value: Any) -> None:
        """Every write of an entry goes through here (a :class:`ResolvedConfig` refuses it)."""
        self.__dict__[key] = value

    def __getattr__(self, key: str) -> Any:
        # a field declared by a plugin registered after this config was made: not set
        if not key.startswith("_") and key in field_table():
            return None
        raise AttributeError(key)

    def _set_custom(self, key: str, value: Any, table: dict[str, FieldSpec]) -> None:
        """Keep ``key`` as a custom entry (written back on save, never read by generate), as
        transformers does; warn when it looks like a misspelt field."""
        close = close_field(key, table)
        if close is not None:
            warn_once(f"`{key}` is not a GenerationConfig field; it is kept as a custom entry (saved with the "
                      f"config, never read by generate). Did you mean `{close}`?")
        self._store(key, value)

    def custom_entries(self) -> dict[str, Any]:
        """The entries that are no field (kept from a file or set by the caller), by name."""
        table = field_table()
        return {k: v for k, v in self.__dict__.items()
                if not k.startswith("_") and k != "transformers_version" and k not in table}

    def _set_fields(self) -> set[str]:
        return {name for name in field_table() if getattr(self, name) is not None}

    # -- dict / json ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (``None`` when not set), the custom entries and the metadata."""
        out = {name: copied(getattr(self, name)) for name in field_table()}
        out.update(copy.deepcopy(self.custom_entries()))
        for key in METADATA:
            out[key] = getattr(self, key)
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        """What differs from ``GenerationConfig()``: the fields set, the custom entries and the
        metadata read with the config (what ``save_pretrained`` writes)."""
        out = {name: copied(value) for name in field_table() if (value := getattr(self, name)) is not None}
        out.update(copy.deepcopy(self.custom_entries()))
        for key in METADATA:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def to_json_string(self, use_diff: bool = True, ignore_metadata: bool = False,
                       keys_to_pop: Iterable[str] | None = None) -> str:
        """JSON as transformers writes it (sorted keys, two-space indent, a final newline)."""
        data = self.to_diff_dict() if use_diff else self.to_dict()
        for key in list(keys_to_pop or ()) + (list(METADATA) if ignore_metadata else []):
            data.pop(key, None)
        return json.dumps(_jsonable(data), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike[str], use_diff: bool = True,
                     keys_to_pop: Iterable[str] | None = None) -> None:
        from ..fileutil import atomic_write_text

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
        table = field_table()
        custom = self.custom_entries() if any(key not in table for key in kwargs) else {}
        used = set()
        for key, value in kwargs.items():
            if key in table or key in custom:
                if not defaults_only or getattr(self, key) is None:
                    self._store(key, _coerced(table[key], value) if key in table else value)
                    used.add(key)
            elif allow_custom_entries and not key.startswith("_") and key not in METADATA:
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
        table = field_table()
        for name, spec in table.items():
            spec.validate(getattr(self, name))
        for arg in GENERATE_ARGUMENTS:
            if arg in self.__dict__:
                raise ConfigError(f"`{arg}` is not a GenerationConfig entry; pass it to generate() directly.")
        check_combinations(self)
        minor = minor_issues(self, table, user_set_attributes)
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
        config = ResolvedConfig.of(self.with_defaults(), assistant_model=assistant_model)
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
                self._store(name, value)
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
        """The config a JSON file holds; a bad value is a ``ConfigError`` naming the file."""
        data = read_config_json(path)
        with _naming_file(path):
            return cls.from_dict(data)  # type: ignore[no-any-return]

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
        config_file_name = _file_name(config_file_name, kwargs)
        return_unused_kwargs = bool(kwargs.pop("return_unused_kwargs", False))
        path, kwargs = resolve_config_file(
            pretrained_model_name, config_file_name or GENERATION_CONFIG_NAME, cache_dir=cache_dir,
            force_download=force_download, local_files_only=local_files_only, token=token, revision=revision,
            **kwargs)
        data = read_config_json(path)
        with _naming_file(path):  # a bad value in the file names it (the keyword overrides are the caller's)
            if kwargs.pop("_from_model_config", False):
                return cls.from_model_config(data)
            config = cls(**data)
        unused = config.update(**kwargs)  # as from_dict applies them
        _log_unused(unused)
        config._loaded_hash = hash(config)
        return (config, unused) if return_unused_kwargs else config

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        config_file_name: str | os.PathLike[str] | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> str:
        """Write ``generation_config.json`` (or ``config_file_name``; ``config_name=`` is accepted as
        an alias, as in ``from_pretrained``) atomically and return its path; with ``push_to_hub=True`` also upload it to ``repo_id=`` (default: the folder's name, in your
        namespace).

        A config changed since it was loaded (or built in code) is validated strictly: a flag that
        would have no effect is an error and nothing is written, as in transformers. A config saved
        unchanged is only warned about, so published configs can always be saved back."""
        config_file_name = _file_name(config_file_name, kwargs)
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
        table = field_table()
        kwargs = {k: v for k, v in data.items() if k in table and v is not None}
        config = cls(_from_model_config=True, **valid_fields(kwargs, table))
        # some models keep generation attributes in their decoder's config
        decoder = _decoder_config(model_config, data)
        if decoder:
            unset = {k: v for k, v in valid_fields(decoder, table).items() if getattr(config, k) is None}
            config._apply(unset)
        if not config.return_dict_in_generate and any(getattr(config, f) for f in EXTRA_OUTPUT_FLAGS):
            config.return_dict_in_generate = True
        config._loaded_hash = hash(config)
        return config


class ResolvedConfig(GenerationConfig):
    """The config a generation runs with: a read-only :class:`GenerationConfig`.

    ``genkit.config.resolve`` builds it (the call merged over the model's generation config and the
    defaults, then the special tokens and the lengths for the prompt); strategies and recipes read
    it like any ``GenerationConfig`` (``max_length``, ``eos_token_id``, ``pad_token_id``, ...).
    Setting an entry raises :class:`~genkit.errors.FrozenConfigError`; :meth:`copy` gives a
    mutable ``GenerationConfig`` with the same values, :meth:`replace` a resolved one with some
    fields changed. Besides the fields it records how they were resolved: :attr:`user_set`,
    :attr:`defaulted` and :attr:`assistant_model`.
    """

    @classmethod
    def of(cls, config: GenerationConfig, user_set: Iterable[str] = (), defaulted: Iterable[str] = (),
           assistant_model: Any = None) -> ResolvedConfig:
        """``config``'s entries (shared, not copied: pass a config nobody else holds), frozen."""
        obj = object.__new__(cls)
        obj.__dict__.update(config.__dict__)
        obj.__dict__.update(_user_set=frozenset(user_set), _defaulted=frozenset(defaulted),
                            _assistant_model=assistant_model)
        return obj

    @property
    def user_set(self) -> frozenset[str]:
        """The fields the caller set (the ``generation_config`` argument's and the keyword
        arguments'); warnings about flags with no effect concern only these."""
        return self.__dict__["_user_set"]  # type: ignore[no-any-return]

    @property
    def defaulted(self) -> frozenset[str]:
        """The fields that took their global default (neither the call nor the model set them)."""
        return self.__dict__["_defaulted"]  # type: ignore[no-any-return]

    @property
    def assistant_model(self) -> Any:
        """The ``assistant_model=`` of the call (the registry's strategy selection reads it), or ``None``."""
        return self.__dict__["_assistant_model"]

    def replace(self, **changes: Any) -> ResolvedConfig:
        """A resolved config with the fields in ``changes`` set (validated) and the rest as here;
        ``assistant_model=`` replaces the assistant."""
        assistant = changes.pop("assistant_model", self.assistant_model)
        table = field_table()
        for key, value in changes.items():
            if key not in table:
                raise unknown_key_error(key, table)
            table[key].validate(value)
        obj = ResolvedConfig.of(self, self.user_set, self.defaulted, assistant)
        obj.__dict__.update(changes)
        return obj

    def _store(self, key: str, value: Any) -> None:
        raise FrozenConfigError(f"the resolved generation config is read-only: cannot set `{key}`. Pass "
                                "settings to generate(), or change a copy (config.copy() is a GenerationConfig).")

    def __delattr__(self, key: str) -> None:
        self._store(key, None)

    def copy(self) -> GenerationConfig:
        """A mutable :class:`GenerationConfig` with the same entries (the resolution record dropped)."""
        config = object.__new__(GenerationConfig)
        config.__dict__.update({k: copy.deepcopy(v) for k, v in self.__dict__.items()
                                if k not in ("_user_set", "_defaulted", "_assistant_model")})
        return config

    def __deepcopy__(self, memo: dict[int, Any]) -> ResolvedConfig:
        """A deep copy that shares the assistant model (a model is never copied with its config)."""
        obj = object.__new__(type(self))
        obj.__dict__.update({k: v if k == "_assistant_model" else copy.deepcopy(v, memo)
                             for k, v in self.__dict__.items()})
        return obj


def valid_fields(values: dict[str, Any], table: dict[str, FieldSpec]) -> dict[str, Any]:
    """The entries of ``values`` that are fields with a valid value (a model config carries
    attributes for other purposes too, and values genkit would refuse). A negative special token
    id (``pad_token_id=-1``, common in model configs) is left out too: a model config's -1 means
    "none", as an unset field does, and is not warned about; not so a value that also holds an id no
    int64 holds (``[10**30, -5]``): kept, ``generate`` refuses it by name."""
    good = {}
    for key, value in values.items():
        if key not in table or value is None or (key in ("eos_token_id", "pad_token_id") and negative_id(value)
                                                 and not past_int64(token_ids_in(value))):
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
    table = field_table()
    for key in unused:
        close = close_field(key, table)
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

