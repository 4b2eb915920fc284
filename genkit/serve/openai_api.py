"""OpenAI request bodies to genkit requests, and genkit results to OpenAI response objects.

Requests are checked field by field: a bad value is an :class:`APIError` naming the parameter
(``param``) and the accepted values, answered with HTTP 400 in OpenAI's error shape. Besides
OpenAI's fields, a body may carry any ``GenerationConfig`` field (those of installed packs too) and
``custom_generate`` (a registered strategy name or a recipe); unknown fields are refused with the
closest names.
"""

from __future__ import annotations

import difflib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .limits import Limits, check_prompt_size

__all__ = ["LOGPROB_FLOOR", "APIError", "ParsedRequest", "TextAssembler", "chat_prompt", "finite_logprob",
           "is_token_ids", "parse_request", "prompt_logprob_entries", "public_message",
           "vllm_prompt_logprobs"]

# OpenAI fields accepted (and not generation fields) per endpoint
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
           "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "custom_generate",
           "use_beam_search"} | {"ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                                  "skip_special_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
                                  "truncate_prompt_tokens"}  # vLLM's (_vllm_kwargs, TextAssembler)
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# (response_format and guided_* are generation fields: genkit.serve.structured; tools: genkit.serve.tools)
# vLLM's chat-template fields (genkit.serve.openai_api.chat_prompt); a request's own `chat_template` is refused
_TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "documents", "chat_template_kwargs",
                    "chat_template"}
_CHAT = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                   "parallel_tool_calls"} | _TEMPLATE_FIELDS
# generation fields the OpenAI fields set: a body may not set them twice (max_length: max_new_tokens,
# which max_tokens sets, would override it)
_SHADOWED = {"max_new_tokens", "max_length", "do_sample", "num_return_sequences", "stop_strings"}
# generation fields for the caller of generate, not for a client: what generate returns besides the
# tokens (the server answers text, and logprobs), and how the engine runs (the server's engine decides)
_NOT_FOR_CLIENTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states",
                    "return_dict_in_generate", "cache_implementation", "cache_config", "max_cache_len",
                    "compile_config", "disable_compile", "continuous_batching_config", "prefill_chunk_size")
# chat roles the template renders ("developer" is OpenAI's newer name for "system")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# the fields of OpenAI's chat messages, by role (``name`` on a tool result too, as vLLM and clients
# such as LangChain send it): the template receives them as sent (as transformers'
# apply_chat_template and vLLM give them); another key is a 400 naming it
_MESSAGE_FIELDS = {"system": ("name",), "developer": ("name",), "user": ("name",),
                   "assistant": ("name", "tool_calls", "refusal"), "tool": ("name", "tool_call_id")}
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@+~-]+){2,}[\\/]?")


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers  # of the response (a 429's Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def public_message(exc: BaseException) -> str:
    """An exception's message for a client: filesystem paths (the model's folder, the Hub
    cache) replaced by ``<path>``."""
    return _PATH.sub("<path>", str(exc))


@dataclass
class ParsedRequest:
    chat: bool
    prompts: list[list[int]]  # one per prompt (chat: one)
    n: int  # choices returned per prompt
    stream: bool
    include_usage: bool
    stop: list[str]
    seed: int | None
    logprobs: int | None  # alternatives per token; None: no logprobs
    max_tokens: int
    min_tokens: int = 0  # vLLM's: no stop string ends a choice before this many tokens (nor an EOS id)
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    skip_special: bool = True  # vLLM's skip_special_tokens
    best_of: int = 1  # choices generated per prompt, the n most likely returned
    echo: list[str] | None = None  # each prompt's text, put before its choices' text
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens lead the choices' logprobs
    prompt_logprobs: int | None = None  # vLLM's: the prompt's tokens scored, this many alternatives each
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_generate: str | None = None
    tools: Any = None  # a genkit.serve.tools.ToolPlan
    id: str = ""
    created: int = 0

    @property
    def engine_logprobs(self) -> int | None:
        """The alternatives asked of the engine: best_of ranks choices by their log-probability."""
        return self.logprobs if self.logprobs is not None or self.best_of == self.n else 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The alternatives per prompt token asked of the engine (None: the prompt is not scored):
        vLLM's ``prompt_logprobs``, and ``logprobs`` for an echoed prompt."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo_logprobs else None) if k is not None]
        return max(asked) if asked else None


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        accepted = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise APIError(f"`{name}` must be {accepted}; got {_short(value)}", name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise APIError(f"`{name}` must be a number between {low} and {high}; got {_short(value)}", name)
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"`{name}` must be true or false; got {_short(value)}", name)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_request(body: Any, *, chat: bool, tokenizer: Any, model_name: str, limits: Limits,
                  generation_fields: set[str], chat_template: str | None = None,
                  model_eos: Any = None, vocab_size: int | None = None) -> ParsedRequest:
    """Check an OpenAI request body and turn it into a :class:`ParsedRequest` (this tokenizes:
    the server calls it off the event loop). ``model_eos``: the model's ``eos_token_id``, which
    vLLM's ``stop_token_ids`` add to; ``vocab_size``: the model's, which vLLM's
    ``allowed_token_ids`` leave the rest of."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", "body")
    from .structured import constrain
    from .tools import parse_tools

    structured = structured_kwargs(body, chat)
    allowed = _CHAT if chat else _COMPLETIONS
    _check_keys(body, allowed, generation_fields)
    _check_model(body, model_name)
    tools = parse_tools(body) if chat else None
    if chat:
        prompts = [chat_prompt(body, tokenizer, limits, chat_template, tools)]
    else:
        prompts = _completion_prompts(body, tokenizer, limits)
    prompts, truncated = _truncate(body, prompts, limits)
    stream = _bool(body, "stream")
    prompt_logprobs = _prompt_logprobs(body, stream, limits)
    scoring = prompt_logprobs is not None or (not chat and _bool(body, "echo"))
    max_tokens = _max_tokens(body, chat, max(len(p) for p in prompts), limits, scoring)
    n, best_of = _choices(body, chat, len(prompts), limits)
    options = _stream_options(body, stream)
    if body.get("user") is not None and not isinstance(body["user"], str):  # it changes nothing, but is typed
        raise APIError(f"`user` must be a string; got {_short(body['user'])}", "user")
    if stream and best_of > n:
        raise APIError("`best_of` > `n` cannot stream: the best choices are known at the end", "best_of")
    logprobs = _logprobs(body, chat, limits)
    echo = _echo(body, chat, prompts, tokenizer, limits.encoder_decoder, truncated)
    _check_scored_entries(prompts, prompt_logprobs, logprobs if echo is not None else None, limits)
    stops = _stops(body, limits)
    kwargs: dict[str, Any] = {k: v for k, v in body.items() if k in generation_fields and k not in allowed}
    kwargs.update(_penalties(body, limits, kwargs))
    kwargs.update(_beam_kwargs(body, n, best_of))
    kwargs.update(_sampling_kwargs(body, kwargs, max_tokens, best_of, stops))
    kwargs.update(_vllm_kwargs(body, kwargs, max_tokens, limits, model_eos))
    kwargs.update(_vllm_token_kwargs(body, kwargs, tokenizer, limits, vocab_size))
    kwargs.update(structured)
    constrain(kwargs, tools)
    custom = body.get("custom_generate")
    if custom is not None and not isinstance(custom, str):
        raise APIError("`custom_generate` must be a registered strategy name or a recipe reference", "custom_generate")
    prefix = "chatcmpl" if chat else "cmpl"
    return ParsedRequest(chat=chat, prompts=prompts, n=n, best_of=best_of, stream=stream,
                         include_usage=bool(options.get("include_usage")), stop=stops,
                         seed=_int(body, "seed", 0, 2**63 - 1), logprobs=logprobs, max_tokens=max_tokens, echo=echo,
                         echo_logprobs=echo is not None and logprobs is not None, prompt_logprobs=prompt_logprobs,
                         min_tokens=kwargs.get("min_new_tokens", 0) if "min_tokens" in body else 0,
                         include_stop=_bool(body, "include_stop_str_in_output"),
                         skip_special=body.get("skip_special_tokens") is None or _bool(body, "skip_special_tokens"),
                         generate_kwargs=kwargs, custom_generate=custom, tools=tools,
                         id=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()))


def _stream_options(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """``stream_options``: an object with ``include_usage`` (true or false) only, sent with
    ``stream: true``."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict) or (options and not stream):
        raise APIError("`stream_options` must be an object, sent with `stream: true`", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise APIError(f"unknown field `stream_options.{unknown[0][:100]}`: `stream_options` takes `include_usage`",
                       "stream_options")
    if options.get("include_usage") is not None and not isinstance(options["include_usage"], bool):  # 1 is no bool
        raise APIError(f"`stream_options.include_usage` must be true or false; got {_short(options['include_usage'])}",
                       "stream_options")
    return options


# --- structured outputs and tools --------------------------------------------------------------
# `response_format` and the guided-decoding fields are generation fields (the built-in
# structured-output processor's): genkit.serve.structured checks them and adds what `tool_choice`
# needs; tools are genkit.serve.tools. These vLLM / legacy OpenAI fields are refused by name.
_UNSUPPORTED_STRUCTURED = ("guided_decoding_backend", "guided_whitespace_pattern", "functions", "function_call")
_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
              "documents", "chat_template_kwargs", "chat_template")


def structured_kwargs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """Refuse the structured-output and tool fields genkit serve does not take (the legacy
    ``functions``, vLLM's backend choice, tools on completions); the others need no settings
    here."""
    for name in _UNSUPPORTED_STRUCTURED + (() if chat else _CHAT_ONLY):
        if body.get(name) is not None:
            where = "by genkit serve" if name in _UNSUPPORTED_STRUCTURED else "on completions (chat only)"
            raise APIError(f"`{name}` is not supported {where}", name, code="not_supported")
    return {}


def _check_keys(body: dict[str, Any], allowed: Any, generation_fields: set[str]) -> None:
    """Every key is an OpenAI parameter of the endpoint or a generation field (not one OpenAI's shadow)."""
    for key in body:
        if key in _SHADOWED:
            raise APIError(f"`{key}` is set through OpenAI's fields here (max_tokens, temperature, n, stop)", key)
        if key in _NOT_FOR_CLIENTS and body[key] is not None and body[key] is not False:  # 0 is not false
            raise APIError(f"`{key}` is not supported by genkit serve: the server answers text (and `logprobs`), "
                           "and its engine decides how a request runs", key, code="not_supported")
        if key not in allowed and key not in generation_fields:
            close = difflib.get_close_matches(key, sorted(allowed | generation_fields), n=3)
            hint = f"; did you mean {', '.join(f'`{c}`' for c in close)}?" if close else ""
            raise APIError(f"unknown field `{key[:100]}`: neither an OpenAI parameter of this endpoint nor a "
                           f"generation parameter{hint}", key)


def _check_model(body: dict[str, Any], model_name: str) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(f"`model` is required; this server serves `{model_name}`", "model")
    if model != model_name:
        raise APIError(f"the model `{str(model)[:100]}` does not exist; this server serves `{model_name}`", "model", 404,
                       code="model_not_found")


def _max_tokens(body: dict[str, Any], chat: bool, prompt_len: int, limits: Limits, scoring: bool = False) -> int:
    """``max_tokens`` (``max_completion_tokens`` for chat, which wins when both are sent; each is
    checked): given, else 16 (completions) or the rest of the context (chat); prompt + completion
    must fit ``limits.max_model_len``. An encoder-decoder model's prompt (its encoder's input) and
    its decoder's tokens (the start token + the completion) must each fit it. 0 only where the prompt is the answer (``scoring``: an
    echoed prompt, or its ``prompt_logprobs``), as OpenAI's legacy completions allow."""
    context = limits.max_model_len
    seq2seq = limits.encoder_decoder
    if context is not None and (prompt_len > context if seq2seq else prompt_len >= context):
        what = "encoder takes" if seq2seq else "context is"
        raise APIError(f"the prompt has {prompt_len} tokens; this model's {what} {context} tokens",
                       "messages" if chat else "prompt", code="context_length_exceeded")
    room = None if context is None else context - (1 if seq2seq else prompt_len)
    given = []  # both names are checked when both are sent; the newer one acts
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        max_tokens = _int(body, name, 0 if scoring else 1, default=None)
        if max_tokens is not None and room is not None and max_tokens > room:
            why = (f"this model's decoder takes {context} tokens, its start token among them" if seq2seq else
                   f"the prompt has {prompt_len} tokens and this model's context is {context}")
            raise APIError(f"`{name}` is {max_tokens}, but {why}: at most {room}", name,
                           code="context_length_exceeded")
        given += [] if max_tokens is None else [int(max_tokens)]
    if not given:
        return min(16, room or 16) if not chat else (room or 2048)
    return given[0]


def _choices(body: dict[str, Any], chat: bool, prompts: int, limits: Limits) -> tuple[int, int]:
    """``n`` and ``best_of`` (completions): ``n <= best_of <= limits.max_n``, and at most
    ``limits.max_choices`` over all prompts."""
    n = _int(body, "n", 1, limits.max_n, default=1)
    best_of = n if chat else _int(body, "best_of", 1, limits.max_n, default=n)
    if best_of < n:
        raise APIError(f"`best_of` must be >= `n` ({n}); got {best_of}", "best_of")
    if prompts * best_of > limits.max_choices:
        raise APIError(f"{prompts} prompts x {best_of} choices is over this server's limit of {limits.max_choices} "
                       "sequences per request", "best_of" if best_of > n else "n")
    return n, best_of


def _stops(body: dict[str, Any], limits: Limits) -> list[str]:
    """``stop``: a string or a list of up to ``limits.max_stops`` strings of at most
    ``limits.max_stop_chars`` characters."""
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > limits.max_stops
            or not all(isinstance(s, str) and len(s) <= limits.max_stop_chars for s in stops)):
        raise APIError(f"`stop` must be a string or a list of up to {limits.max_stops} strings of at most "
                       f"{limits.max_stop_chars} characters; got {_short(stop)}", "stop")
    if "" in stops:  # vLLM's answer too: an empty stop string would end every text before it starts
        raise APIError("`stop` cannot contain an empty string", "stop")
    return list(stops)


def _penalties(body: dict[str, Any], limits: Limits, fields: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` as the generation
    fields whose processors ``generate`` runs (``sequence_bias`` with one-token sequences)."""
    kwargs: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value:
            kwargs[name] = value
    bias = body.get("logit_bias")
    if bias is None:
        return kwargs
    if "sequence_bias" in fields:
        raise APIError("`logit_bias` and `sequence_bias` set the same processor; send one", "logit_bias")
    if not isinstance(bias, dict) or len(bias) > limits.max_logit_bias:
        raise APIError(f"`logit_bias` must be an object of at most {limits.max_logit_bias} "
                       "{\"token id\": bias} entries", "logit_bias")
    pairs = []
    for key, value in bias.items():
        # the ids' upper bound is the model's vocabulary, checked with the other settings' token ids
        # (genkit.config.checks.check_vocabulary, as `sequence_bias`)
        digits = key.strip() if isinstance(key, str) else ""
        token = int(digits) if digits.isascii() and digits.isdecimal() and len(digits) <= 12 else -1
        if token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(f"`logit_bias` maps token ids (ints >= 0, as strings) to numbers between -100 and 100; "
                           f"got {_short(key)}: {_short(value)}", "logit_bias")
        if value:
            pairs.append([[token], float(value)])
    if pairs:
        kwargs["sequence_bias"] = pairs
    return kwargs


def _beam_kwargs(body: dict[str, Any], n: int, best_of: int) -> dict[str, Any]:
    """vLLM's ``use_beam_search``: beam search ``n`` beams wide, its ``n`` best hypotheses the
    choices (``n`` 1: greedy search). Beam search does not sample: a ``temperature`` other than 0,
    and ``num_beams`` or ``best_of`` beside it, are refused."""
    if not _bool(body, "use_beam_search"):
        return {}
    if body.get("num_beams") is not None:
        raise APIError("`use_beam_search` sets `num_beams` (to `n`); send one of them", "use_beam_search")
    if best_of != n:
        raise APIError("`use_beam_search` returns the `n` best hypotheses of one beam search; `best_of` must be `n`",
                       "best_of")
    if body.get("temperature") not in (None, 0):
        raise APIError("`use_beam_search` runs beam search, which does not sample: leave `temperature` out or send "
                       "0 (beam sampling: `num_beams` with a `temperature`)", "temperature")
    return {"num_beams": n, "do_sample": False}


def _sampling_kwargs(body: dict[str, Any], fields: dict[str, Any], max_tokens: int, choices: int,
                     stops: list[str]) -> dict[str, Any]:
    """The generation settings OpenAI's fields stand for, given the generation ``fields`` sent as they are.
    Whether the request samples (one rule, whatever its ``n``): ``temperature`` decides where it is
    sent (0: greedy); else the request samples if it asks for several choices or sets a field that
    acts only when sampling (:func:`_asks_to_sample`), and otherwise as the model's generation
    config says (what ``generate`` merges it with). Sampling without a ``temperature`` uses the
    model's, else 1 (OpenAI's default). A request that runs beam search (``num_beams``) samples only
    with a ``temperature``: beam sampling."""
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise APIError("`top_p` must be a number in (0, 1]; got 0", "top_p")
    # max_tokens 0 (a prompt only scored) generates nothing: the settings are checked as for one token
    kwargs: dict[str, Any] = {"max_new_tokens": max(1, max_tokens)}
    if temperature is not None:
        if temperature == 0.0:
            kwargs["do_sample"] = False
        else:
            kwargs["do_sample"] = True
            kwargs["temperature"] = temperature
    if top_p is not None:
        kwargs["top_p"] = top_p
    if "do_sample" not in {**fields, **kwargs} and "num_beams" not in fields and _asks_to_sample(body, fields, choices):
        kwargs["do_sample"] = True  # as OpenAI's temperature default of 1
    if stops:
        kwargs["stop_strings"] = stops
    return kwargs


def _asks_to_sample(body: dict[str, Any], fields: dict[str, Any], choices: int) -> bool:
    """Whether a request without ``temperature`` asks to sample: several choices, a ``seed``, or a
    field that acts only when sampling (``top_p``, ``top_k``, ``min_p``, ``typical_p``, ...:
    genkit.config.checks.SAMPLING_FLAGS), set to anything but null. ``top_k`` beside
    ``penalty_alpha`` is contrastive search's candidates per step, not a sampling field."""
    from genkit.config.checks import SAMPLING_FLAGS

    contrastive = fields.get("penalty_alpha") is not None
    names = ["seed"] + [name for name, _ in SAMPLING_FLAGS if name != "temperature"
                        and not (name == "top_k" and contrastive)]
    return choices > 1 or any(body.get(name) is not None for name in names)


def _vllm_kwargs(body: dict[str, Any], fields: dict[str, Any], max_tokens: int, limits: Limits,
                 model_eos: Any) -> dict[str, Any]:
    """vLLM's sampling fields as generation settings (and ``top_k: -1``, vLLM's "every token", as
    ``top_k: 0``). ``ignore_eos``: no end-of-sequence token ends
    a choice; ``stop_token_ids``: these tokens end it too (added to the EOS ids: the model's, or the
    request's ``eos_token_id``; none with ``ignore_eos``); like an EOS token, a stop token is the
    choice's last token, its text kept unless it is a special token. ``min_tokens``:
    ``min_new_tokens``, so none of those ids is chosen before that many tokens, and no stop string
    ends the text before them either (:class:`TextAssembler`), as in vLLM."""
    from genkit.config.resolve import eos_token_ids

    kwargs: dict[str, Any] = {}
    top_k = body.get("top_k")
    if top_k == -1 and not isinstance(top_k, bool):  # vLLM's "every token" (generate's is 0; -1 is refused there)
        kwargs["top_k"] = 0
    ignore = _bool(body, "ignore_eos")
    if ignore and fields.get("eos_token_id") is not None:
        raise APIError("`ignore_eos` and `eos_token_id` contradict each other; send one", "ignore_eos")
    stop_ids = _stop_token_ids(body, limits)
    if ignore or stop_ids:
        base = [] if ignore else eos_token_ids(fields.get("eos_token_id", model_eos))
        kwargs["eos_token_id"] = list(dict.fromkeys(base + stop_ids)) or None
    min_tokens = _int(body, "min_tokens", 0, default=0)
    if min_tokens:
        if fields.get("min_new_tokens") is not None:
            raise APIError("`min_tokens` is vLLM's name of `min_new_tokens`; send one", "min_tokens")
        if min_tokens > max_tokens:
            raise APIError(f"`min_tokens` must be <= `max_tokens` ({max_tokens}); got {min_tokens}", "min_tokens")
        kwargs["min_new_tokens"] = min_tokens
    return kwargs


def _truncate(body: dict[str, Any], prompts: list[list[int]], limits: Limits) -> tuple[list[list[int]], bool]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last k tokens (-1: the model's context,
    ``max_model_len``); whether a prompt was cut."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return prompts, False
    if k == -1 and not isinstance(k, bool):
        if limits.max_model_len is None:
            raise APIError("`truncate_prompt_tokens` -1 keeps the model's context, which this server does not know: "
                           "send a number of tokens", "truncate_prompt_tokens")
        k = limits.max_model_len
    k = _int({"truncate_prompt_tokens": k}, "truncate_prompt_tokens", 1)
    return [p[-k:] for p in prompts], any(len(p) > k for p in prompts)


def _vllm_token_kwargs(body: dict[str, Any], fields: dict[str, Any], tokenizer: Any, limits: Limits,
                       vocab_size: int | None) -> dict[str, Any]:
    """vLLM's ``allowed_token_ids`` (every other token of the vocabulary suppressed:
    ``suppress_tokens``, with the request's own) and ``bad_words`` (``bad_words_ids``: each word's
    tokens as written, and after a space, as vLLM tokenizes them; the last token of each is never
    chosen where the ones before it end the sequence, as transformers' ``bad_words_ids``)."""
    kwargs: dict[str, Any] = {}
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if (not allowed or vocab_size is None or len(allowed) > vocab_size
                or not is_token_ids(allowed, vocab_size)):
            raise APIError(f"`allowed_token_ids` must be a non-empty list of token ids from 0 to "
                           f"{'the vocabulary' if vocab_size is None else vocab_size - 1}; got {_short(allowed)}",
                           "allowed_token_ids")
        keep = set(allowed)
        own = fields.get("suppress_tokens") or []
        kwargs["suppress_tokens"] = sorted({t for t in range(vocab_size) if t not in keep} | set(own))
    words = body.get("bad_words")
    if words is not None:
        if (not isinstance(words, list) or len(words) > limits.max_bad_words
                or not all(isinstance(w, str) and w.strip() and len(w) <= limits.max_stop_chars for w in words)):
            raise APIError(f"`bad_words` must be a list of at most {limits.max_bad_words} non-blank strings of at "
                           f"most {limits.max_stop_chars} characters; got {_short(words)}", "bad_words")
        ids = [list(seq) for seq in fields.get("bad_words_ids") or []]
        for word in words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            # vLLM's rule: the spaced form too where it is a word of its own (a new first token, as many tokens)
            ids += [seq for seq in (plain, spaced if spaced[:1] != plain[:1] and len(spaced) == len(plain) else [])
                    if seq and seq not in ids]
        kwargs["bad_words_ids"] = ids
    return kwargs


def _stop_token_ids(body: dict[str, Any], limits: Limits) -> list[int]:
    """``stop_token_ids``: a list of at most ``limits.max_stop_token_ids`` token ids (their upper
    bound, the vocabulary, is checked with the other settings' ids: genkit.config.checks)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not is_token_ids(ids) or len(ids) > limits.max_stop_token_ids:
        raise APIError(f"`stop_token_ids` must be a list of at most {limits.max_stop_token_ids} token ids (ints >= 0); "
                       f"got {_short(ids)}", "stop_token_ids")
    return list(ids)


def _completion_prompts(body: dict[str, Any], tokenizer: Any, limits: Limits) -> list[list[int]]:
    """``prompt``: a string, a list of token ids, or a list of either (one request per prompt)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("`prompt` is required", "prompt")
    many = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    items = prompt if many else [prompt]
    if len(items) > limits.max_prompts:
        raise APIError(f"`prompt` holds {len(items)} prompts; this server takes at most {limits.max_prompts}",
                       "prompt")
    # a prompt vLLM's truncate_prompt_tokens cuts may be longer than the context
    context = limits.max_model_len if body.get("truncate_prompt_tokens") is None else None
    out = [_one_prompt(p, tokenizer, context) for p in items]
    if not all(out):
        raise APIError("the prompt is empty", "prompt")
    return out


def is_token_ids(value: Any, high: int | None = None, low: int | None = 0) -> bool:
    """Whether ``value`` is a list of token ids: ints (not bools) from ``low`` (None: any) to
    ``high`` - 1 (None: no upper bound)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and (low is None or t >= low) and (high is None or t < high)
        for t in value)


def _one_prompt(prompt: Any, tokenizer: Any, context: int | None) -> list[int]:
    if isinstance(prompt, str):
        check_prompt_size(tokenizer, prompt, context, "prompt")
        return list(tokenizer.encode(prompt))
    if prompt and is_token_ids(prompt, low=None):
        bad = [t for t in prompt if t < 0 or t >= len(tokenizer)]
        if bad:
            raise APIError(f"`prompt` holds token ids outside the vocabulary: {bad[:5]}", "prompt")
        return list(prompt)
    raise APIError("`prompt` must be a string, a list of token ids, or a list of those", "prompt")


def chat_prompt(body: dict[str, Any], tokenizer: Any, limits: Limits, chat_template: str | None,
                tools: Any = None) -> list[int]:
    """The prompt of a chat request; ``tools`` (a :class:`genkit.serve.tools.ToolPlan`) go into it
    as the template takes them, with vLLM's template fields (:func:`_template_options`)."""
    from .tools import template_has_tools, with_tools

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > limits.max_messages:
        raise APIError(f"`messages` must be a non-empty list of at most {limits.max_messages} {{role, content}} "
                       "objects", "messages")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise APIError("this model's tokenizer has no chat template, so chat messages cannot be rendered: send the "
                       "text to /v1/completions, or start the server with `genkit serve --chat-template TEMPLATE`",
                       "messages", code="not_supported")
    native = template_has_tools(template)
    clean, extra = with_tools([_message(i, m, native) for i, m in enumerate(messages)], tools, native)
    options = _template_options(body, template)
    _check_rendered_size(clean, tokenizer, limits, chat_template, body, {**options, **extra})
    try:
        ids = tokenizer.apply_chat_template(clean, chat_template=chat_template, tokenize=True, return_dict=False,
                                            **options, **extra)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
        raise APIError(f"the chat template cannot render these messages: {public_message(exc)}", "messages") from exc
    ids = [int(t) for t in ids]
    if not ids:
        raise APIError("the prompt is empty", "messages")
    return ids


def _check_rendered_size(messages: list[dict[str, Any]], tokenizer: Any, limits: Limits, chat_template: str | None,
                         body: dict[str, Any], options: dict[str, Any]) -> None:
    """:func:`check_prompt_size` on the rendered prompt of ``messages`` whose text is long enough for
    it to count (rendered once more, as text; a template's failure is left to the render that
    tokenizes); none with ``truncate_prompt_tokens``, which may cut a longer prompt."""
    context = limits.max_model_len
    if context is None or body.get("truncate_prompt_tokens") is not None:
        return
    if len(str(messages)) + len(str(options)) <= context:  # far within the size that counts
        return
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False, **options)
    except Exception:  # noqa: BLE001 - said by the render that tokenizes
        return
    if isinstance(text, str):
        check_prompt_size(tokenizer, text, context, "messages")


# what the server sets itself: chat_template_kwargs may not set these
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                "chat_template", "bos_token", "eos_token", "unk_token", "pad_token")


def _template_options(body: dict[str, Any], template: Any) -> dict[str, Any]:
    """vLLM's chat-template fields: ``add_generation_prompt`` (default true), ``continue_final_message``
    (not both), ``documents`` (a list of objects, for a template that renders them) and
    ``chat_template_kwargs`` (an object of variables the template reads, e.g. ``enable_thinking``). A
    request's own ``chat_template`` is refused, as vLLM does by default."""
    if body.get("chat_template") is not None:
        raise APIError("`chat_template` in a request is not supported: the server renders the model's template "
                       "(`genkit serve --chat-template` sets another)", "chat_template", code="not_supported")
    generation = True if body.get("add_generation_prompt") is None else _bool(body, "add_generation_prompt")
    cont = _bool(body, "continue_final_message")
    if generation and cont:
        raise APIError("`continue_final_message` continues the final message; set `add_generation_prompt` to false "
                       "with it (they cannot both be true)", "continue_final_message")
    options: dict[str, Any] = {"add_generation_prompt": generation, "continue_final_message": cont}
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise APIError("`documents` must be a list of objects (e.g. {\"title\", \"text\"})", "documents")
        if "documents" not in _template_variables(template):
            raise APIError("`documents`: this model's chat template does not render documents", "documents",
                           code="not_supported")
        options["documents"] = documents
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise APIError(f"`chat_template_kwargs` must be an object; got {_short(kwargs)}", "chat_template_kwargs")
        reserved = [k for k in kwargs if k in _RESERVED_TEMPLATE_VARIABLES]
        unread = sorted(set(kwargs) - _template_variables(template) - set(reserved))
        if reserved or unread:
            what = (f"sets {', '.join(f'`{k}`' for k in reserved)}, which the server sets" if reserved else
                    f"has {', '.join(f'`{_short(k)}`' for k in unread[:8])}, which this model's chat template "
                    "does not read")
            raise APIError(f"`chat_template_kwargs` {what}", "chat_template_kwargs")
        options.update(kwargs)
    return options


def _template_variables(template: Any) -> frozenset[str]:
    """The variables a chat template reads from outside (as vLLM filters ``chat_template_kwargs``)."""
    from ..chat_template import template_variables

    return template_variables(template) if isinstance(template, str) else frozenset()


def _message(i: int, m: Any, native: bool = False) -> dict[str, Any]:
    """One chat message as the template takes it; a role other than OpenAI's, or a message
    without its content, is refused. A tool result or an assistant's tool calls are written as
    the template takes them (``native``: it renders tools itself; genkit.serve.tools)."""
    if not isinstance(m, dict) or "role" not in m:
        raise APIError(f"`messages[{i}]` must be an object with a `role` and a `content`", "messages")
    role = m["role"]
    if role == "function":
        raise APIError(f"`messages[{i}]`: the legacy `function` role is not supported; use `tool`", "messages",
                       code="not_supported")
    if not isinstance(role, str) or role not in _MESSAGE_FIELDS:  # a list or an object is no role either
        raise APIError(f"`messages[{i}].role` must be one of {', '.join(sorted(_MESSAGE_FIELDS))}; got "
                       f"{_short(role)}", "messages")
    passed = _passed_fields(i, m, role)
    if role == "tool" or m.get("tool_calls") is not None:
        from .tools import tool_message

        calls = role == "assistant" and m.get("tool_calls") is not None
        return {**tool_message(i, m, _content(i, m, optional=calls), native), **passed}
    return {"role": _ROLES[role], "content": _content(i, m), **passed}


def _passed_fields(i: int, m: dict[str, Any], role: str) -> dict[str, Any]:
    """The message's other OpenAI fields that go to the template as sent (``name``, an assistant's
    ``refusal``), checked; a key OpenAI's message of this role does not have is a 400 naming it."""
    known = ("role", "content", *_MESSAGE_FIELDS[role])
    unknown = [k for k in m if k not in known]
    if unknown:
        raise APIError(f"`messages[{i}]` (role `{role}`) has fields this server does not take: "
                       f"{', '.join(_short(k) for k in unknown[:8])}; it takes {', '.join(known)}", "messages")
    passed = {}
    for key in ("name", "refusal", "tool_call_id"):
        value = m.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise APIError(f"`messages[{i}].{key}` must be a string; got {_short(value)}", "messages")
        if key != "tool_call_id":  # the tool path writes it (genkit.serve.tools.tool_message)
            passed[key] = value
    return passed


def _content(i: int, m: dict[str, Any], optional: bool = False) -> str:
    """A message's text (``optional``: an assistant's tool calls may come without content)."""
    if "content" not in m and not optional:
        raise APIError(f"`messages[{i}].content` is required", "messages")
    content = m.get("content")
    if content is None and optional:
        return ""
    if isinstance(content, list):  # content parts: text only
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                continue
            what = f"a part of type {_short(kind)}" if kind not in (None, "text") else "not a text part"
            raise APIError(f"`messages[{i}].content[{j}]` is {what}: genkit serve reads text only (images, audio and "
                           "files are not taken); content parts must be {\"type\": \"text\", \"text\": ...}",
                           "messages")
        unknown = sorted({k for p in content for k in p if k not in ("type", "text")})
        if unknown:
            raise APIError(f"`messages[{i}].content` parts have fields a text part does not take: "
                           f"{', '.join(_short(k) for k in unknown[:8])}; it takes type, text", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"`messages[{i}].content` must be a string or a list of text parts", "messages")
    return content


def _logprobs(body: dict[str, Any], chat: bool, limits: Limits) -> int | None:
    """Alternatives per token: chat's ``logprobs`` (true or false) + ``top_logprobs``, or
    completions' ``logprobs`` (an integer)."""
    if not chat:
        return _int(body, "logprobs", 0, limits.max_logprobs, default=None)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, limits.max_top_logprobs, default=None)
    if top is not None and not want:
        raise APIError("`top_logprobs` needs `logprobs: true`", "top_logprobs")
    return (top or 0) if want else None


def _prompt_logprobs(body: dict[str, Any], stream: bool, limits: Limits) -> int | None:
    """vLLM's ``prompt_logprobs``: score the prompt's own tokens, with this many alternatives each
    (0: the token's own log-probability and rank only). Not streamed (as in vLLM); not for an
    encoder-decoder model, whose prompt is its encoder's input."""
    if body.get("prompt_logprobs") is None:
        return None
    if body["prompt_logprobs"] == -1 and not isinstance(body["prompt_logprobs"], bool):
        raise APIError(f"`prompt_logprobs` -1 (every token of the vocabulary) is over this server's limit: "
                       f"send an int from 0 to {limits.max_prompt_logprobs}", "prompt_logprobs")
    top = _int(body, "prompt_logprobs", 0, limits.max_prompt_logprobs)
    if stream:
        raise APIError("`prompt_logprobs` is not available with `stream`: send the request without streaming",
                       "prompt_logprobs")
    if limits.encoder_decoder:
        raise APIError("`prompt_logprobs` is not supported for an encoder-decoder model: its prompt is the encoder's "
                       "input, which the model gives no probabilities to", "prompt_logprobs", code="not_supported")
    return int(top)


def _check_scored_entries(prompts: list[list[int]], prompt_logprobs: int | None, echoed: int | None,
                          limits: Limits) -> None:
    """The prompt log-probabilities a request asks for (each scored token's own and its alternatives,
    over its prompts) within ``limits.max_prompt_logprob_entries``, before anything is computed."""
    asked = [(name, k) for name, k in (("prompt_logprobs", prompt_logprobs), ("logprobs", echoed)) if k is not None]
    if not asked:
        return
    name, top = max(asked, key=lambda a: a[1])
    entries = sum(len(p) - 1 for p in prompts) * (1 + top)
    if entries > limits.max_prompt_logprob_entries:
        raise APIError(f"the prompt log-probabilities asked for are {entries} entries (prompt tokens x (1 + `{name}`) "
                       f"over the prompts); this server answers at most {limits.max_prompt_logprob_entries}: send fewer "
                       "or shorter prompts, or fewer alternatives", name)


def _echo(body: dict[str, Any], chat: bool, prompts: list[list[int]], tokenizer: Any,
          encoder_decoder: bool = False, truncated: bool = False) -> list[str] | None:
    """``echo`` (completions): each prompt's text before its choices' text (with ``logprobs``, the
    prompt's tokens and their log-probabilities lead the choice's); refused for an encoder-decoder
    model, whose completion does not continue its prompt. ``suffix`` is refused: the served models
    have no fill-in-the-middle mode."""
    if chat:
        return None
    if body.get("suffix") not in (None, ""):
        raise APIError("`suffix` is not supported: genkit serve has no fill-in-the-middle (insert) mode", "suffix",
                       code="not_supported")
    if not _bool(body, "echo"):
        return None
    if encoder_decoder:
        raise APIError("`echo` is not supported for an encoder-decoder model: the prompt is the encoder's input and "
                       "the completion the decoder's own text, which does not continue it", "echo",
                       code="not_supported")
    raw = body["prompt"]
    texts = raw if isinstance(raw, list) and all(isinstance(p, str) for p in raw) and raw else None
    if isinstance(raw, str):
        texts = [raw]
    if truncated:  # the prompt the model read (truncate_prompt_tokens)
        texts = None
    return list(texts) if texts is not None else [tokenizer.decode(p) for p in prompts]


class TextAssembler:
    """The text of one choice, token by token: complete characters only, cut at the first stop
    string (which is not part of the text unless ``include_stop``), and never releasing text that
    could still turn out to begin a stop string. As vLLM's: a stop string ends the text only where
    a token after the first ``min_tokens`` completes it; special tokens are left out unless
    ``skip_special`` is false. Decoding is incremental (a window of the last tokens, as vLLM does),
    so each token costs the same however long the text already is."""

    def __init__(self, tokenizer: Any, stops: list[str], min_tokens: int = 0, include_stop: bool = False,
                 skip_special: bool = True) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.min_tokens, self.include_stop, self.skip_special = min_tokens, include_stop, skip_special
        self.tokens = 0  # added
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already: the context of the next piece
        self.read = 0
        self.sent = 0  # characters released
        self.stopped = False
        self.text = ""

    def add(self, token: int, special: set[int]) -> str:
        """Add a token; return the text that can be released now."""
        if self.stopped:
            return ""
        self.tokens += 1
        if token not in special or not self.skip_special:
            self.ids.append(token)
        new = self._new_text()
        if not new:
            return ""
        start = len(self.text)
        text = self.text + new
        if self.tokens > self.min_tokens:
            text = self._cut(text, start)
        self.text = text
        hold = 0 if self.stopped else self._held_back(text)
        out = text[self.sent:len(text) - hold]
        self.sent = max(self.sent, len(text) - hold)
        return out

    def _cut(self, text: str, start: int) -> str:
        """``text`` up to the first stop string the text after ``start`` completes (through it with
        ``include_stop``)."""
        found = [(at, stop) for stop in self.stops  # only where the new text can complete a stop string
                 if (at := text.find(stop, max(0, start - len(stop) + 1))) != -1]
        if not found:
            return text
        at, stop = min(found)
        self.stopped = True
        return text[:at + len(stop) if self.include_stop else at]

    def _new_text(self) -> str:
        """The text the tokens since ``read`` add, once their characters are complete."""
        decode = self.tokenizer.decode
        known = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special)
        window = decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special)
        if window.endswith("\ufffd") or len(window) <= len(known):  # a character cut between tokens
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(known):]

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that are the start of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    longest = max(longest, k)
                    break
        return longest


LOGPROB_FLOOR = -9999.0  # vLLM's: a token a processor ruled out (-inf) is reported at this, JSON has no -inf


def finite_logprob(logprob: float) -> float:
    """``logprob`` as JSON can carry it: at least :data:`LOGPROB_FLOOR` (as vLLM reports them)."""
    return max(float(logprob), LOGPROB_FLOOR)


def logprob_entry(tokenizer: Any, token: int, logprob: float, alternatives: list[tuple[int, float]]) -> dict[str, Any]:
    """One chat ``logprobs.content`` entry."""
    text = tokenizer.decode([token])
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": finite_logprob(lp),
                              "bytes": list(tokenizer.decode([t]).encode("utf-8"))} for t, lp in alternatives]}


def prompt_logprob_entries(event: Any, top: int) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
    """An echoed prompt's entries in completions' ``logprobs``, as the choices' own tokens' (token,
    log-probability, ``top`` alternatives): the first token has none (``null``, as OpenAI's legacy
    completions report it), each other token its :class:`genkit.serve.engine.PromptEvent` score."""
    first: list[tuple[int, float | None, list[tuple[int, float]] | None]] = [(event.prompt_ids[0], None, None)]
    return first + [(s.token, s.logprob, list(s.top[:top])) for s in event.scores]


def vllm_prompt_logprobs(tokenizer: Any, event: Any, top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then per token a map of token id
    (a JSON string) to ``{"logprob", "rank", "decoded_token"}``, holding the prompt's token and the
    ``top`` most likely ones at its position (the token's own entry first; one entry where it is
    among them)."""
    out: list[dict[str, Any] | None] = [None]
    for s in event.scores:
        entry = {str(s.token): _vllm_logprob(tokenizer, s.token, s.logprob, s.rank)}
        for rank, (t, lp) in enumerate(s.top[:top], start=1):
            entry.setdefault(str(t), _vllm_logprob(tokenizer, t, lp, rank))
        out.append(entry)
    return out


def _vllm_logprob(tokenizer: Any, token: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": tokenizer.decode([token])}
