"""Budgets for reading model files, and the checks of a model's config against them.

Every count, length and dimension read from a model file is checked against the file's size and
against these limits before anything is allocated (docs/models.md, "Limits"). Each limit can be
raised with its environment variable (a positive integer). A refusal is a
:class:`~genkit.errors.ModelFileError` naming the file, the field and the limit.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, ModelFileError
from .base import QWEN3_HEAD_DIM

#: name -> (environment variable, default)
LIMITS: dict[str, tuple[str, int]] = {
    "gguf_tensors": ("GENKIT_MAX_GGUF_TENSORS", 65_536),
    "gguf_metadata_keys": ("GENKIT_MAX_GGUF_KEYS", 65_536),
    "gguf_array_elements": ("GENKIT_MAX_GGUF_ARRAY_ELEMENTS", 4_194_304),
    "safetensors_header_bytes": ("GENKIT_MAX_SAFETENSORS_HEADER", 100_000_000),
    "config_bytes": ("GENKIT_MAX_CONFIG_BYTES", 16_000_000),
    "layers": ("GENKIT_MAX_LAYERS", 1024),
    "dimension": ("GENKIT_MAX_DIMENSION", 1_048_576),
    "vocab": ("GENKIT_MAX_VOCAB", 16_777_216),
    # a GGUF 'llama' vocabulary without merges: the characters their derivation from the scores reads
    # (genkit.tokenizer.sentencepiece_merge_work: about 1 s of work at the default)
    "tokenizer_merge_work": ("GENKIT_MAX_TOKENIZER_MERGE_WORK", 1_000_000_000),
}


def limit(name: str) -> int:
    """The limit ``name`` (a key of :data:`LIMITS`), from its environment variable or its default."""
    var, default = LIMITS[name]
    value = env_int(var, f"a positive integer (default {default})")
    return default if value is None else value


def env_int(var: str, accepted: str) -> int | None:
    """The positive integer the environment variable ``var`` sets, ``None`` when it is unset; any
    other value is a ConfigError naming the variable and the ``accepted`` values."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{var}={raw!r} is not accepted; use {accepted}")
    return value


def over(name: str) -> str:
    """How to raise the limit ``name``, for error messages."""
    var, _ = LIMITS[name]
    return f"the limit is {limit(name)}; set {var} to raise it"


# per architecture family: config field -> kind of limit; the first four are required
_LLAMA_FIELDS = {"num_hidden_layers": "layers", "hidden_size": "dimension", "num_attention_heads": "dimension",
                 "vocab_size": "vocab", "num_key_value_heads": "dimension", "intermediate_size": "dimension",
                 "head_dim": "dimension"}
_GPT2_FIELDS = {"n_layer": "layers", "n_embd": "dimension", "n_head": "dimension", "vocab_size": "vocab",
                "n_positions": "dimension", "n_inner": "dimension"}
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_EMBEDDINGS = ("model.embed_tokens.weight", "transformer.wte.weight")


def _int_field(config: Any, key: str, kind: str, where: str, required: bool) -> int | None:
    value = config.get(key)
    if value is None:
        if required:
            raise ModelFileError(f"{where}: `{key}` is missing; it must be a positive integer")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFileError(f"{where}: `{key}` must be a positive integer; got {value!r}")
    if value <= 0 or value > limit(kind):
        raise ModelFileError(f"{where}: `{key}`={value} is out of range: it must be between 1 and "
                             f"{limit(kind)} ({over(kind)})")
    return value


# config fields the native models read besides the sizes: field -> what it must be (None is
# always accepted: the field is left at its default)
_FLOAT_FIELDS = {"rms_norm_eps": "a finite number >= 0", "layer_norm_epsilon": "a finite number >= 0",
                 "rope_theta": "a finite number > 0", "partial_rotary_factor": "a finite number in (0, 1]"}
_COUNT_FIELDS = ("max_position_embeddings", "sliding_window", "max_window_layers")  # integers >= 0
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx", "is_encoder_decoder")
_STR_FIELDS = ("model_type", "hidden_act", "activation_function")
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "rope_theta")


def _float_ok(key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if key == "partial_rotary_factor":
        return 0 < value <= 1
    return value > 0 if key == "rope_theta" else value >= 0


def _check_rope(config: Any, where: str) -> None:
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ModelFileError(f"{where}: `{key}` must be an object (or null); got {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if not isinstance(kind, str):
            raise ModelFileError(f"{where}: `{key}.rope_type` must be a string; got {kind!r}")
        for name in _ROPE_NUMBERS:
            value = rope.get(name)
            if value is not None and not (_float_ok("rope_theta", value)):
                raise ModelFileError(f"{where}: `{key}.{name}` must be a finite number > 0; got {value!r}")
        if kind == "llama3" and rope.get("low_freq_factor", 1.0) == rope.get("high_freq_factor", 4.0):
            raise ModelFileError(f"{where}: `{key}`: `low_freq_factor` and `high_freq_factor` must differ")


def _check_fields(config: Any, where: str) -> None:
    """The types and ranges of the config fields the native models read besides the sizes: a
    ``ModelFileError`` naming the field, never a NaN norm or a string read as true."""
    for key, accepted in _FLOAT_FIELDS.items():
        value = config.get(key)
        if value is not None and not _float_ok(key, value):
            raise ModelFileError(f"{where}: `{key}` must be {accepted}; got {value!r}")
    for key in _COUNT_FIELDS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ModelFileError(f"{where}: `{key}` must be an integer >= 0 (or null); got {value!r}")
    for key in _BOOL_FIELDS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelFileError(f"{where}: `{key}` must be true or false; got {value!r}")
    for key in _STR_FIELDS:
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise ModelFileError(f"{where}: `{key}` must be a string; got {value!r}")
    for key in ("architectures", "layer_types"):
        value = config.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise ModelFileError(f"{where}: `{key}` must be a list of strings; got {value!r}")
    _check_rope(config, where)


def _llama_family(config: Any) -> bool:
    """Whether ``config`` names an architecture (or a model_type) that the native Llama class builds
    (``genkit.models.loading.ARCHITECTURES``)."""
    from .loading import ARCHITECTURES, MODEL_TYPES

    names = {*(config.get("architectures") or ()), MODEL_TYPES.get(config.get("model_type") or "")}
    return any(ARCHITECTURES.get(name or "", "").endswith(":LlamaForCausalLM") for name in names)


def check_config(config: Any, where: str, shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Check a model config: its sizes positive integers within the limits, consistent with each
    other and, given the ``shapes`` of the file's tensors, with what the file holds (as many
    layers as it says, an embedding of ``vocab_size x hidden_size``); its other fields of the
    type and range the models read (finite norms and rope settings, booleans, strings)."""
    _check_fields(config, where)
    gpt2 = config.get("model_type") == "gpt2" or "GPT2LMHeadModel" in (config.get("architectures") or ())
    fields = _GPT2_FIELDS if gpt2 else _LLAMA_FIELDS
    # (the Llama family's MLP has no default width: a config without one built no model, a TypeError)
    llama = _llama_family(config)
    required = {*list(fields)[:4], *(("intermediate_size",) if llama else ())}
    values = {key: _int_field(config, key, kind, where, key in required) for key, kind in fields.items()}
    layers_key, hidden_key, heads_key = list(fields)[:3]
    layers, hidden, heads = values[layers_key], values[hidden_key], values[heads_key]
    assert layers is not None and hidden is not None and heads is not None  # required above
    qwen3 = config.get("model_type") == "qwen3"  # Qwen3Config's head_dim is 128 when left out
    if values.get("head_dim") is None and hidden % heads and not qwen3:
        raise ModelFileError(f"{where}: `{hidden_key}`={hidden} is not a multiple of `{heads_key}`={heads}")
    head_dim = values.get("head_dim") or (QWEN3_HEAD_DIM if qwen3 else hidden // heads)
    if not gpt2 and head_dim % 2:  # (the Llama family's rope turns every dimension, partial_rotary_factor or not)
        raise ModelFileError(f"{where}: the head size ({head_dim} rotary dimensions) must be even: rope turns "
                             "pairs of dimensions")
    kv = values.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise ModelFileError(f"{where}: `num_attention_heads`={heads} is not a multiple of "
                             f"`num_key_value_heads`={kv}")
    if config.get("layer_types") is not None and len(config.get("layer_types")) != layers:
        raise ModelFileError(f"{where}: `layer_types` has {len(config.get('layer_types'))} entries for "
                             f"`{layers_key}`={layers} layers")
    if shapes is None:
        return
    found = {int(m.group(1)) for name in shapes if (m := _LAYER_INDEX.search(name))}
    if layers != len(found) or (found and max(found) != layers - 1):
        raise ModelFileError(f"{where}: `{layers_key}`={layers}, but the file holds the tensors of "
                             f"{len(found)} layers")
    embed = next((shapes[n] for n in _EMBEDDINGS if n in shapes), None)
    want = (values["vocab_size"], hidden)
    if embed is not None and tuple(embed) != want:
        raise ModelFileError(f"{where}: the token embedding has shape {tuple(embed)}, but `vocab_size` x "
                             f"`{hidden_key}` is {want}")
