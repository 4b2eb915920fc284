"""What genkit implements and what it refuses: fields a ``generation_config.json`` may hold but
generate cannot honour yet (:data:`NOT_SUPPORTED`, refused by :func:`check_supported`), and fields
accepted with no effect on the output (:data:`NO_EFFECT`)."""

from __future__ import annotations

from typing import Any

from ..errors import NotSupportedError
from ..plugins import get_registry
from .fields import field_table

NOT_SUPPORTED: dict[str, str] = {
    "cache_config": "quantized or offloaded caches (no issue yet); leave it unset, genkit preallocates its cache",
    "use_mtp": "multi-token-prediction heads (no issue yet); use assistant_model= or prompt_lookup_num_tokens=",
    "token_healing": "token healing (no issue yet)",
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
    "decoder_start_token_id": "the decoder's first token of an encoder-decoder model (docs/encoder_decoder.md); "
                              "no effect on decoder-only models",
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
    table = field_table()
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

