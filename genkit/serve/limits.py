"""The bounds of one request to ``genkit serve``: each one exceeded is a 400 naming the field.

The body size is checked while the body streams in (:mod:`genkit.serve.security`); the JSON
nesting depth when it is parsed (:func:`load_json`); the rest by the request parser
(:mod:`genkit.serve.openai_api`) before anything is queued.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["SEQ2SEQ_FALLBACK_LEN", "Limits", "check_prompt_size", "check_width", "default_max_model_len", "load_json",
           "position_limit"]

# positions an encoder-decoder checkpoint may name (its own config's, or its encoder's and decoder's)
_POSITION_FIELDS = ("max_position_embeddings", "max_encoder_position_embeddings", "max_decoder_position_embeddings",
                    "max_source_positions", "max_target_positions", "n_positions")
# an encoder-decoder model whose config and tokenizer name no length (T5's relative positions): vLLM's
# fallback for a config that names none
SEQ2SEQ_FALLBACK_LEN = 2048
# transformers' tokenizers write int(1e30) as model_max_length when they know of no limit
_NO_TOKENIZER_LIMIT = 10**9


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (``max_model_len``: prompt + completion tokens, ``--max-model-len``; with
    ``encoder_decoder``, the prompt is an encoder-decoder model's encoder input, and ``max_model_len``
    bounds it and the decoder's tokens apart: the encoder's prompt tokens, and the decoder's start
    token + the completion)."""

    max_model_len: int | None = None
    encoder_decoder: bool = False
    max_n: int = 16  # n and best_of; num_beams; contrastive search's top_k
    max_prompts: int = 32  # prompts in one /v1/completions request
    max_choices: int = 64  # prompts x the sequences each computes at once (best_of, beams, candidates)
    # stop strings (OpenAI takes 4, vLLM any number: lm-evaluation-harness's tasks send 5 and more)
    max_stops: int = 32
    max_bad_words: int = 256  # vLLM's bad_words
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256  # vLLM's stop_token_ids
    max_logprobs: int = 5  # completions' logprobs
    max_top_logprobs: int = 20  # chat's top_logprobs
    max_prompt_logprobs: int = 20  # vLLM's prompt_logprobs (its default max_logprobs)
    # prompt tokens scored x (1 + alternatives each), over a request's prompts: ~80 bytes of JSON each
    max_prompt_logprob_entries: int = 2**18
    max_logit_bias: int = 1024  # entries
    max_json_depth: int = 32
    max_messages: int = 1024


def load_json(raw: bytes, max_depth: int) -> Any:
    """Parse a request body; too deep a nesting, a number Python will not convert (over 4300
    digits) or a string holding a lone UTF-16 surrogate (``"\\ud800"``: no text a tokenizer can
    encode) is a 400, never a 500."""
    from .openai_api import APIError

    try:
        body = json.loads(raw)
    except RecursionError:
        body = None
        too_deep = True
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc.__class__.__name__} at {_where(exc)}",
                       "body") from None
    except ValueError as exc:  # an integer literal over Python's int_max_str_digits
        raise APIError(f"the request body is not valid JSON here: {exc}", "body") from None
    else:
        too_deep = _depth(body, max_depth) > max_depth
    if too_deep:
        raise APIError(f"the request body nests JSON deeper than this server's limit of {max_depth} levels",
                       "body", code="json_too_deep")
    return body


def position_limit(model: Any) -> int | None:
    """The most positions ``model`` has: a decoder-only model's ``max_position_embeddings``; an
    encoder-decoder model's smallest position table (encoder or decoder; ``None`` for relative
    positions, as T5's)."""
    from genkit.generation.encoder_decoder import is_encoder_decoder

    config = model.config
    if not is_encoder_decoder(model):
        return getattr(config, "max_position_embeddings", None)
    configs = [config, getattr(config, "encoder", None), getattr(config, "decoder", None)]
    sizes = [getattr(c, name, None) for c in configs if c is not None for name in _POSITION_FIELDS]
    sizes = [v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(sizes) if sizes else None


def default_max_model_len(model: Any, tokenizer: Any) -> int | None:
    """``max_model_len`` when ``--max-model-len`` is not given: :func:`position_limit`; for an
    encoder-decoder model without one, its tokenizer's ``model_max_length`` (T5's 512), else
    :data:`SEQ2SEQ_FALLBACK_LEN` (its encoder's attention grows with the square of the prompt)."""
    from genkit.generation.encoder_decoder import is_encoder_decoder

    limit = position_limit(model)
    if limit is not None or not is_encoder_decoder(model):
        return limit
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, int) and not isinstance(length, bool) and 0 < length < _NO_TOKENIZER_LIMIT:
        return length
    return SEQ2SEQ_FALLBACK_LEN


# a text of more characters than this per token of the context is counted window by window before it
# is tokenized whole (check_prompt_size); each window is at most this many characters
_CHARS_PER_CONTEXT_TOKEN = 8
_WINDOW_CHARS = 16384
_SLACK_PER_WINDOW = 16  # tokens a window's edges may add or take from the text's own tokenization


def check_prompt_size(tokenizer: Any, text: str, context: int | None, param: str) -> None:
    """Refuse (400 ``context_length_exceeded``) a prompt ``text`` far over ``context`` tokens without
    tokenizing it whole: a tokenizer's memory grows with the tokens it makes (a 4 MiB body of
    ``"ab "`` made 2.8 million, 700 MB, for a context of 512). A text of more than
    ``_CHARS_PER_CONTEXT_TOKEN`` characters per context token is counted a window at a time, and
    refused once its windows' tokens pass the context (plus what their cut edges may add); a text
    that fits, or within that length, is left to be tokenized as it was."""
    if context is None or len(text) <= _CHARS_PER_CONTEXT_TOKEN * context:
        return
    from .openai_api import APIError

    count = 0
    for window, at in enumerate(range(0, len(text), _WINDOW_CHARS), 1):
        count += len(tokenizer.encode(text[at:at + _WINDOW_CHARS], add_special_tokens=False))
        if count > context + _SLACK_PER_WINDOW * window:
            raise APIError(f"the prompt has more than {context} tokens ({count} in its first {at + _WINDOW_CHARS} "
                           f"of {len(text)} characters); this model's context is {context} tokens", param,
                           code="context_length_exceeded")


def check_width(num_beams: Any, top_k: Any, penalty_alpha: Any, prompts: int, best_of: int, limits: Limits) -> None:
    """The sequences a request computes at once, bounded before anything is allocated: beam
    search runs ``num_beams`` of them per prompt, contrastive search (``penalty_alpha`` > 0) scores
    ``top_k`` candidates of each of its ``best_of`` choices; each of ``num_beams`` and that
    ``top_k`` at most ``limits.max_n``, and all prompts' together at most ``limits.max_choices``."""
    from .openai_api import APIError

    beams = num_beams if isinstance(num_beams, int) else 1
    contrastive = isinstance(penalty_alpha, (int, float)) and penalty_alpha > 0 and isinstance(top_k, int)
    name, width = ("num_beams", beams) if beams > 1 else ("top_k", top_k) if contrastive else (None, 1)
    if name is None:
        return
    if width > limits.max_n:
        what = "beams" if name == "num_beams" else "candidates per step (contrastive search)"
        raise APIError(f"`{name}` must be <= {limits.max_n} on this server ({what}); got {width}", name)
    rows = width if name == "num_beams" else width * best_of
    if prompts * rows > limits.max_choices:
        raise APIError(f"{prompts} prompts x {rows} sequences each (`{name}` {width}"
                       f"{f' x best_of {best_of}' if name == 'top_k' else ''}) is over this server's limit of "
                       f"{limits.max_choices} sequences per request", name)


def _where(exc: Exception) -> str:
    return f"position {getattr(exc, 'pos', getattr(exc, 'start', '?'))}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of ``value`` (iteratively; stops counting past ``limit``). A string (a
    key or a value) holding a lone surrogate is a 400 naming the top-level field it is in."""
    from .openai_api import APIError

    deepest = 0
    todo: list[tuple[Any, int, str]] = [(value, 1, "body")]
    while todo:
        item, depth, field = todo.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise APIError(f"`{field}` holds a lone UTF-16 surrogate (an escape such as \\ud800 that is no "
                               "character); send valid Unicode text", field)
            continue
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(item, list):
            todo.extend((v, depth + 1, field) for v in item)
            continue
        for k, v in item.items():
            inner = k if depth == 1 and not _SURROGATE.search(k) else field
            todo += [(k, depth + 1, field), (v, depth + 1, inner)]
    return deepest
