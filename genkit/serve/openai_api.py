"""OpenAI request bodies to genkit requests, and genkit results to OpenAI response objects.

Requests are checked field by field: a bad value is an :class:`APIError` naming the parameter
(``param``) and the accepted values, answered with HTTP 400 in OpenAI's error shape. Besides
OpenAI's fields, a body may carry any ``GenerationConfig`` field (those of installed packs too) and
``custom_generate`` (a registered strategy name or a recipe); unknown fields are refused with the
closest names.
"""

from __future__ import annotations

import difflib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["APIError", "ParsedRequest", "TextAssembler", "parse_request"]

# OpenAI fields accepted (and not generation fields) per endpoint
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
           "user", "logprobs", "presence_penalty", "frequency_penalty", "custom_generate"}
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix", "best_of", "logit_bias"}
# (response_format is a generation field: genkit.serve.structured; tools: genkit.serve.tools)
_CHAT = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "logit_bias", "tools", "tool_choice",
                   "parallel_tool_calls", "store", "metadata"}
# generation fields the OpenAI fields set: a body may not set them twice
_SHADOWED = {"max_new_tokens", "do_sample", "num_return_sequences", "stop_strings"}


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    seed: int | None
    logprobs: int | None  # alternatives per token; None: no logprobs
    max_tokens: int
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    custom_generate: str | None = None
    tools: Any = None  # a genkit.serve.tools.ToolPlan
    id: str = ""
    created: int = 0


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        accepted = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise APIError(f"`{name}` must be {accepted}; got {value!r}", name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise APIError(f"`{name}` must be a number between {low} and {high}; got {value!r}", name)
    return float(value)


def parse_request(body: Any, *, chat: bool, tokenizer: Any, model_name: str, max_positions: int | None,
                  generation_fields: set[str]) -> ParsedRequest:
    """Check an OpenAI request body and turn it into a :class:`ParsedRequest`."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    allowed = _CHAT if chat else _COMPLETIONS
    _check_keys(body, allowed, generation_fields)
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(f"the model `{model}` does not exist; this server serves `{model_name}`", "model", 404,
                       code="model_not_found")
    from .structured import structured_kwargs
    from .tools import chat_prompt, parse_tools, uses_tools

    tools = parse_tools(body) if chat else None
    if chat and uses_tools(body):
        prompt_ids = chat_prompt(body, tokenizer, tools)
    else:
        prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    if not prompt_ids:
        raise APIError("the prompt is empty", "messages" if chat else "prompt")
    max_tokens = _max_tokens(body, chat, len(prompt_ids), max_positions)
    n = _int(body, "n", 1, 16, default=1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise APIError("`top_p` must be a number in (0, 1]; got 0", "top_p")
    stops = _stops(body)
    seed = _int(body, "seed", 0, 2**63 - 1)
    logprobs = _logprobs(body, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"`stream` must be true or false; got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("`stream_options` must be an object", "stream_options")
    kwargs: dict[str, Any] = {k: v for k, v in body.items() if k in generation_fields and k not in allowed}
    kwargs.update(_sampling_kwargs(kwargs, max_tokens, temperature, top_p, n, stops))
    structured_kwargs(kwargs, tools)
    custom = body.get("custom_generate")
    if custom is not None and not isinstance(custom, str):
        raise APIError("`custom_generate` must be a registered strategy name or a recipe reference", "custom_generate")
    prefix = "chatcmpl" if chat else "cmpl"
    return ParsedRequest(chat=chat, prompt_ids=prompt_ids, n=n, stream=stream,
                         include_usage=bool(options.get("include_usage", False)), stop=stops, seed=seed,
                         logprobs=logprobs, max_tokens=max_tokens, generate_kwargs=kwargs, custom_generate=custom, tools=tools,
                         id=f"{prefix}-{uuid.uuid4().hex[:24]}", created=int(time.time()))


def _check_keys(body: dict[str, Any], allowed: Any, generation_fields: set[str]) -> None:
    """Every key is an OpenAI parameter of the endpoint or a generation field (not one OpenAI's shadow)."""
    for key in body:
        if key in _SHADOWED:
            raise APIError(f"`{key}` is set through OpenAI's fields here (max_tokens, temperature, n, stop)", key)
        if key not in allowed and key not in generation_fields:
            close = difflib.get_close_matches(key, sorted(allowed | generation_fields), n=3)
            hint = f"; did you mean {', '.join(f'`{c}`' for c in close)}?" if close else ""
            raise APIError(f"unknown field `{key}`: neither an OpenAI parameter of this endpoint nor a generation "
                           f"parameter{hint}", key)


def _max_tokens(body: dict[str, Any], chat: bool, prompt_len: int, max_positions: int | None) -> int:
    """``max_tokens`` (``max_completion_tokens`` for chat): given, else 16 (completions) or the rest
    of the context (chat); cut to the model's context."""
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, 1, default=None)
    if max_tokens is None:
        max_tokens = 16 if not chat else max(1, (max_positions or 2048) - prompt_len)
    if max_positions is not None and prompt_len >= max_positions:
        raise APIError(f"the prompt has {prompt_len} tokens; this model's context is {max_positions} tokens",
                       "messages" if chat else "prompt")
    if max_positions is not None and prompt_len + max_tokens > max_positions:
        max_tokens = max_positions - prompt_len
    return max_tokens


def _stops(body: dict[str, Any]) -> list[str]:
    """``stop``: a string or a list of up to 4 non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = list(stop)
    else:
        raise APIError(f"`stop` must be a string or a list of up to 4 non-empty strings; got {stop!r}", "stop")
    return [s for s in stops if s]


def _sampling_kwargs(fields: dict[str, Any], max_tokens: int, temperature: float | None, top_p: float | None,
                     n: int, stops: list[str]) -> dict[str, Any]:
    """The generation settings OpenAI's fields stand for, given the generation ``fields`` sent as they are."""
    kwargs: dict[str, Any] = {"max_new_tokens": max_tokens}
    if temperature is not None:
        if temperature == 0.0:
            kwargs["do_sample"] = False
        else:
            kwargs["do_sample"] = True
            kwargs["temperature"] = temperature
    if top_p is not None:
        kwargs["top_p"] = top_p
    if n > 1 and not {**fields, **kwargs}.get("do_sample", False) and "num_beams" not in fields:
        kwargs["do_sample"] = True  # n choices need sampling (as OpenAI's temperature default of 1)
    if stops:
        kwargs["stop_strings"] = stops
    return kwargs


def _completion_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = getattr(tokenizer, "vocab_size", None)
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= len(tokenizer))]
        if bad:
            raise APIError(f"`prompt` holds token ids outside the vocabulary: {bad[:5]}", "prompt")
        return list(prompt)
    raise APIError("`prompt` must be a string or a list of token ids (one prompt per request)", "prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: Any) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("`messages` must be a non-empty list of {role, content} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"`messages[{i}]` must be an object with a `role` and a `content`", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(f"`messages[{i}].content` must be a string or a list of text parts", "messages")
        clean.append({"role": m["role"], "content": content})
    try:
        ids = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
        raise APIError(f"the chat template cannot render these messages: {exc}", "messages") from exc
    return [int(t) for t in ids]


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        want = body.get("logprobs")
        if want not in (None, True, False):
            raise APIError(f"`logprobs` must be true or false; got {want!r}", "logprobs")
        top = _int(body, "top_logprobs", 0, 20, default=None)
        if top is not None and not want:
            raise APIError("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        return (top or 0) if want else None
    return _int(body, "logprobs", 0, 5, default=None)


class TextAssembler:
    """The text of one choice, token by token: complete characters only, cut at the first stop
    string (which is not part of the text), and never releasing text that could still turn out
    to begin a stop string."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0  # characters released
        self.stopped = False
        self.text = ""

    def add(self, token: int, special: set[int]) -> str:
        """Add a token; return the text that can be released now."""
        if self.stopped:
            return ""
        if token not in special:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character cut between tokens
            return ""
        for stop in self.stops:
            at = text.find(stop)
            if at != -1:
                text = text[:at]
                self.stopped = True
        self.text = text
        hold = 0 if self.stopped else self._held_back(text)
        out = text[self.sent:len(text) - hold]
        self.sent = max(self.sent, len(text) - hold)
        return out

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


def logprob_entry(tokenizer: Any, token: int, logprob: float, alternatives: list[tuple[int, float]]) -> dict[str, Any]:
    """One chat ``logprobs.content`` entry."""
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": lp,
                              "bytes": list(tokenizer.decode([t]).encode("utf-8"))} for t, lp in alternatives]}
