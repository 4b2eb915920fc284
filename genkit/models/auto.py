"""``genkit.AutoModelForCausalLM`` and ``genkit.AutoTokenizer``: transformers' names for
:func:`~genkit.models.loading.load_model` and :func:`~genkit.models.loading.load_tokenizer`, so a
transformers script runs on genkit with its import line changed (docs/api.md, "The one-import swap").

Every keyword transformers' ``from_pretrained`` takes that genkit can honour is honoured; any other
is a :class:`~genkit.errors.ConfigError` naming it and the accepted ones, never silently ignored.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from .loading import load_model, load_tokenizer

MODEL_KWARGS = ("dtype", "torch_dtype", "device_map", "device", "revision", "trust_remote_code", "dequantize",
                "gguf_file", "low_cpu_mem_usage")
TOKENIZER_KWARGS = ("revision", "gguf_file", "padding_side", "truncation_side", "model_max_length", "use_fast",
                    "trust_remote_code", "bos_token", "eos_token", "unk_token", "pad_token")


def _check_call(what: str, extra_args: tuple[Any, ...], kwargs: dict[str, Any], accepted: tuple[str, ...],
                flag: str, why: str) -> None:
    """Refuse positional arguments after the reference, keywords outside ``accepted``, and
    ``flag``=False (a transformers option genkit only has one way of doing, ``why``); pops ``flag``."""
    if extra_args:
        raise ConfigError(f"{what}.from_pretrained takes the reference and keywords only; got {len(extra_args)} "
                          "extra positional argument(s)")
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"{what}.from_pretrained: {', '.join(f'`{k}`' for k in unknown)} not supported by genkit; "
                          f"accepted: {', '.join(accepted)}")
    if kwargs.pop(flag, True) is not True:
        raise ConfigError(f"`{flag}`=False is not supported; accepted: True ({why})")


def _reference(path: str | os.PathLike[str], gguf_file: str | None) -> str:
    """``path``, or with transformers' ``gguf_file=`` the GGUF file inside that folder."""
    return os.path.join(os.fspath(path), gguf_file) if gguf_file else os.fspath(path)


class AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained(ref, **kwargs)`` is ``genkit.load_model``: a native
    model from a folder, a ``.gguf``, a Hub id or ``"smollm2"``."""

    def __init__(self) -> None:
        raise ConfigError("AutoModelForCausalLM is not instantiated; use AutoModelForCausalLM.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], *model_args: Any,
                        **kwargs: Any) -> Any:
        """Load a native model. Keywords as in transformers: ``dtype`` / ``torch_dtype``,
        ``device_map`` (one device: ``"auto"``, ``"cpu"``, ``"cuda:0"``, ``{"": device}``),
        ``revision``, ``trust_remote_code``, ``gguf_file`` (a ``.gguf`` inside the folder),
        ``low_cpu_mem_usage`` (genkit always loads tensor by tensor); and genkit's ``device``,
        ``dequantize``."""
        _check_call("AutoModelForCausalLM", model_args, kwargs, MODEL_KWARGS, "low_cpu_mem_usage",
                    "genkit always loads the weights tensor by tensor")
        ref = _reference(pretrained_model_name_or_path, kwargs.pop("gguf_file", None))
        return load_model(ref, **kwargs)


class AutoTokenizer:
    """``AutoTokenizer.from_pretrained(ref, **kwargs)`` is ``genkit.load_tokenizer``, with the
    tokenizer settings transformers accepts there."""

    def __init__(self) -> None:
        raise ConfigError("AutoTokenizer is not instantiated; use AutoTokenizer.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike[str], *inputs: Any,
                        **kwargs: Any) -> Any:
        """Load a tokenizer. Keywords as in transformers: ``revision``, ``gguf_file``,
        ``padding_side``, ``truncation_side``, ``model_max_length``, the special tokens
        (``pad_token="</s>"``...), ``use_fast`` (True only: genkit's tokenizers are the fast ones),
        ``trust_remote_code`` (accepted: genkit runs no tokenizer code)."""
        _check_call("AutoTokenizer", inputs, kwargs, TOKENIZER_KWARGS, "use_fast",
                    "genkit reads tokenizer.json, the fast tokenizer format")
        kwargs.pop("trust_remote_code", None)
        ref = _reference(pretrained_model_name_or_path, kwargs.pop("gguf_file", None))
        tokenizer = load_tokenizer(ref, revision=kwargs.pop("revision", None))
        for name in ("padding_side", "truncation_side"):
            if name in kwargs and kwargs[name] not in ("left", "right"):
                raise ConfigError(f"`{name}`={kwargs[name]!r} is not valid; accepted: 'left', 'right'")
        for name, value in kwargs.items():
            setattr(tokenizer, name, value)
        return tokenizer
