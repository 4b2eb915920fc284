"""GenerationConfig fields owned by the built-in logits processors (torch-free)."""

from __future__ import annotations

import json
from numbers import Integral, Real
from typing import Any

from genkit.config.fields import is_finite, token_ids_in
from genkit.errors import ConfigError
from genkit.plugins import FieldSpec


def _int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


FLOAT32_MAX = 3.4028234663852886e38


def _num(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _ids(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) and x >= 0 for x in v)


def _id_lists(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) > 0
            and all(isinstance(s, (list, tuple)) and len(s) > 0 and _ids(s) for s in v))


def parse_bias_key(key: Any) -> Any:
    """A ``sequence_bias`` dict key: a tuple of ids, or its string form ``"(1, 2)"`` as
    transformers writes it in ``generation_config.json``."""
    if isinstance(key, str):
        import ast

        try:
            value = ast.literal_eval(key.strip())
        except (ValueError, SyntaxError):
            return key
        if isinstance(value, int):
            value = (value,)
        return tuple(value) if isinstance(value, (tuple, list)) else key
    return key


def _sequence_bias(v: Any) -> bool:
    if isinstance(v, dict):
        items = [(parse_bias_key(k), b) for k, b in v.items()]
        if not all(isinstance(k, tuple) for k, _ in items):
            return False
    elif isinstance(v, (list, tuple)):
        items = [tuple(x) for x in v]
        if not all(len(x) == 2 and isinstance(x[0], (list, tuple)) for x in items):
            return False
    else:
        return False
    return len(items) > 0 and all(_ids(list(k)) and len(k) > 0 and _bias(b) for k, b in items)


def _bias(b: Any) -> bool:
    """A bias the float32 scores can take: a number of at most float32's largest magnitude, or -inf /
    +inf (1e308 was a RuntimeError, "value cannot be converted to type float without overflow")."""
    return _num(b) and (is_finite(b) and abs(b) <= FLOAT32_MAX or b in (float("inf"), float("-inf")))


def _bias_ids(v: Any) -> list[Any]:
    """The token ids the sequences of a ``sequence_bias`` value hold."""
    keys = [parse_bias_key(k) for k in v] if isinstance(v, dict) else [pair[0] for pair in v]
    return token_ids_in(keys)


def _temperature(v: Any) -> bool:
    return _num(v) and 0 <= v < float("inf")


def _decay(v: Any) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2 and _int(v[0]) and v[0] >= 0
            and is_finite(v[1]) and v[1] > 1.0)


def _switch(name: str, default: Any, check: Any, accepted: str, token_ids: Any = None) -> FieldSpec:
    """A processor's field: ``None`` passed to generate turns the processor off (transformers 5).
    ``token_ids``: the ids a value holds, checked against the model's vocabulary."""
    return FieldSpec(name, default, check, accepted, off_when_none=True, token_ids=token_ids)


TEMPERATURE = _switch("temperature", 1.0, _temperature, "a finite number >= 0 (>= 1e-05 when sampling)")
TOP_K = _switch("top_k", 50, lambda v: _int(v) and v >= 0, "an int >= 0 (0 disables)")
TOP_P = _switch("top_p", 1.0, lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]")
MIN_P = _switch("min_p", None, lambda v: _num(v) and 0 <= v <= 1, "a number in [0, 1] or None")
TOP_H = _switch("top_h", None, lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1] or None")
TYPICAL_P = _switch("typical_p", 1.0, lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]")
EPSILON_CUTOFF = _switch("epsilon_cutoff", 0.0, lambda v: _num(v) and 0 <= v < 1, "a number in [0, 1)")
ETA_CUTOFF = _switch("eta_cutoff", 0.0, lambda v: _num(v) and 0 <= v < 1, "a number in [0, 1)")
REPETITION_PENALTY = _switch("repetition_penalty", 1.0, lambda v: is_finite(v) and v > 0, "a finite number > 0")
ENCODER_REPETITION_PENALTY = _switch("encoder_repetition_penalty", 1.0, lambda v: is_finite(v) and v > 0,
                                     "a finite number > 0")
PRESENCE_PENALTY = _switch("presence_penalty", None, lambda v: _num(v) and -2 <= v <= 2,
                           "a number between -2.0 and 2.0, or None (0 and None disable)")
FREQUENCY_PENALTY = _switch("frequency_penalty", None, lambda v: _num(v) and -2 <= v <= 2,
                            "a number between -2.0 and 2.0, or None (0 and None disable)")
NO_REPEAT_NGRAM_SIZE = _switch("no_repeat_ngram_size", 0, lambda v: _int(v) and v >= 0, "an int >= 0")
ENCODER_NO_REPEAT_NGRAM_SIZE = _switch("encoder_no_repeat_ngram_size", 0, lambda v: _int(v) and v >= 0,
                                       "an int >= 0")
BAD_WORDS_IDS = _switch("bad_words_ids", None, _id_lists,
                        "a non-empty list of non-empty lists of token ids >= 0, or None", token_ids_in)
RENORMALIZE_LOGITS = _switch("renormalize_logits", False, lambda v: isinstance(v, bool), "True or False")
FORCED_BOS = _switch("forced_bos_token_id", None, lambda v: _int(v) and v >= 0, "a token id >= 0 or None",
                     token_ids_in)
FORCED_EOS = _switch("forced_eos_token_id", None,
                     lambda v: (_int(v) and v >= 0) or (_ids(v) and len(v) > 0),
                     "a token id >= 0, a list of ids, or None", token_ids_in)
REMOVE_INVALID = _switch("remove_invalid_values", False, lambda v: isinstance(v, bool), "True or False")
DECAY = _switch("exponential_decay_length_penalty", None, _decay,
                "a pair (start_index: int >= 0, decay_factor: finite number > 1.0) or None")
SUPPRESS = _switch("suppress_tokens", None, lambda v: _ids(v) and len(v) > 0, "a list of token ids >= 0 or None",
                   token_ids_in)
BEGIN_SUPPRESS = _switch("begin_suppress_tokens", None, lambda v: _ids(v) and len(v) > 0,
                         "a list of token ids >= 0 or None", token_ids_in)
SEQUENCE_BIAS = _switch("sequence_bias", None, _sequence_bias,
                        "a non-empty dict {tuple of token ids: bias} or a non-empty list of [list of token ids, bias] "
                        "pairs (each bias a number within float32's range, or -inf / inf), or None", _bias_ids)

ALL = (TEMPERATURE, TOP_K, TOP_P, MIN_P, TOP_H, TYPICAL_P, EPSILON_CUTOFF, ETA_CUTOFF, REPETITION_PENALTY,
       ENCODER_REPETITION_PENALTY, NO_REPEAT_NGRAM_SIZE, ENCODER_NO_REPEAT_NGRAM_SIZE, BAD_WORDS_IDS,
       RENORMALIZE_LOGITS, FORCED_BOS, FORCED_EOS, REMOVE_INVALID, DECAY, SUPPRESS, BEGIN_SUPPRESS,
       SEQUENCE_BIAS, PRESENCE_PENALTY, FREQUENCY_PENALTY)


# -- structured outputs (builtin_strategies/structured.py): at most one of these is set ---------------
def _schema(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _response_format(v: Any) -> bool:
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name": str, "schema": {...}, "strict": bool, "description": str}}``."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        return False
    if v["type"] != "json_schema":
        return set(v) == {"type"}
    spec = v.get("json_schema")
    return (set(v) == {"type", "json_schema"} and isinstance(spec, dict)
            and set(spec) <= {"name", "schema", "strict", "description"} and _schema(spec.get("schema"))
            and isinstance(spec.get("name", ""), str) and isinstance(spec.get("strict", False), (bool, type(None))))


def _as_schema(v: Any) -> Any:
    """``guided_json`` given as JSON text becomes the schema it holds."""
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except ValueError as exc:
        raise ConfigError(f"`guided_json` must be a JSON schema (a dict or its JSON text); got text that is not "
                          f"JSON: {exc}") from exc


RESPONSE_FORMAT = FieldSpec(
    "response_format", None, _response_format,
    '{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": str, '
    '"schema": {...}, "strict": bool}} or None',
    "Constrain the output to JSON (any object, or one matching `json_schema.schema`), as OpenAI's field.")
GUIDED_JSON = FieldSpec("guided_json", None, _schema, "a JSON schema (a dict, or its JSON text) or None",
                        "Constrain the output to JSON matching this schema (vLLM's field).", coerce=_as_schema)
GUIDED_REGEX = FieldSpec("guided_regex", None, lambda v: isinstance(v, str) and bool(v),
                         "a non-empty regular expression (str) or None",
                         "Constrain the output to match this regular expression (vLLM's field).")
GUIDED_GRAMMAR = FieldSpec("guided_grammar", None, lambda v: isinstance(v, str) and bool(v.strip()),
                           "a non-empty context-free grammar (Lark or GBNF text) or None",
                           "Constrain the output to this context-free grammar (vLLM's field).")
# llguidance builds a grammar of at most 65525 symbols and panics past it (somewhere past 30,000 short
# choices): the longest choice list taken, checked before anything is compiled
MAX_CHOICES = 16384
GUIDED_CHOICE = FieldSpec("guided_choice", None,
                          lambda v: isinstance(v, (list, tuple)) and 0 < len(v) <= MAX_CHOICES
                          and all(isinstance(s, str) and s for s in v),
                          f"a non-empty list of at most {MAX_CHOICES} non-empty strings or None",
                          "The output is exactly one of these strings (vLLM's field).")
STRUCTURED = (RESPONSE_FORMAT, GUIDED_JSON, GUIDED_REGEX, GUIDED_GRAMMAR, GUIDED_CHOICE)
