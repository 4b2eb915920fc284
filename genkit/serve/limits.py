"""The bounds of one request to ``genkit serve``: each one exceeded is a 400 naming the field.

The body size is checked while the body streams in (:mod:`genkit.serve.security`); the JSON
nesting depth when it is parsed (:func:`load_json`); the rest by the request parser
(:mod:`genkit.serve.openai_api`) before anything is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Limits", "load_json"]


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (``max_model_len``: prompt + completion tokens, ``--max-model-len``)."""

    max_model_len: int | None = None
    max_n: int = 16  # n and best_of
    max_prompts: int = 32  # prompts in one /v1/completions request
    max_choices: int = 64  # prompts x best_of
    max_stops: int = 4
    max_stop_chars: int = 256
    max_logprobs: int = 5  # completions' logprobs
    max_top_logprobs: int = 20  # chat's top_logprobs
    max_logit_bias: int = 1024  # entries
    max_json_depth: int = 32
    max_messages: int = 1024


def load_json(raw: bytes, max_depth: int) -> Any:
    """Parse a request body; too deep a nesting is a 400 (before and after the parser's own
    recursion limit), never a 500."""
    from .openai_api import APIError

    try:
        body = json.loads(raw)
    except RecursionError:
        body = None
        too_deep = True
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc.__class__.__name__} at {_where(exc)}",
                       "body") from None
    else:
        too_deep = _depth(body, max_depth) > max_depth
    if too_deep:
        raise APIError(f"the request body nests JSON deeper than this server's limit of {max_depth} levels",
                       "body", code="json_too_deep")
    return body


def _where(exc: Exception) -> str:
    return f"position {getattr(exc, 'pos', getattr(exc, 'start', '?'))}"


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of ``value`` (iteratively; stops counting past ``limit``)."""
    deepest = 0
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest
