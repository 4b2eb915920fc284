"""The ASGI application of ``genkit serve`` (Starlette): OpenAI's completions and chat completions,
models, tokenize/detokenize, version, health and Prometheus metrics.

Requests pass :mod:`genkit.serve.security` first (Host, Origin, API key, JSON bodies, body size).
A completion then takes a slot of :mod:`genkit.serve.admission` (else a 429) before it is
tokenized, and gives it back when its response ends, however it ends.
A body is parsed and tokenized on a worker thread (the event loop keeps answering ``/health``).
Streaming responses are server-sent events (``data: {json}``, then ``data: [DONE]``). A client
that disconnects cancels its request, streaming or not: the stream's ``finally`` or a watcher of
the connection cancels it in the engine, which frees its cache blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from genkit.errors import NotSupportedError
from genkit.strategy import openai_finish_reason

from .admission import ABORT_EXTENSION, DEFAULT_MAX_CONCURRENT_REQUESTS, Admission, SendDeadline, Slot, within
from .engine import PromptEvent, Request, RequestStream
from .limits import Limits, check_width, default_max_model_len, load_json
from .openai_api import (
    APIError,
    ParsedRequest,
    TextAssembler,
    chat_prompt,
    finite_logprob,
    is_token_ids,
    logprob_entry,
    parse_request,
    prompt_logprob_entries,
    public_message,
    vllm_prompt_logprobs,
)
from .security import ServePolicy, middleware
from .tools import ToolStream, parse_tools

logger = logging.getLogger("genkit.serve")

__all__ = ["ServerState", "create_app"]


class ServerState:
    """What the routes share: the model's name, tokenizer, engine, and the server's policy."""

    def __init__(self, model: Any, tokenizer: Any, engine: Any, model_name: str, *,
                 trust_remote_code: bool = False, allowed_recipes: list[str] | None = None,
                 policy: ServePolicy | None = None, max_model_len: int | None = None,
                 chat_template: str | None = None, max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 request_timeout: float | None = None, enable_tokenizer_info_endpoint: bool = False) -> None:
        from genkit.config import field_table
        from genkit.generation.api import as_protocol_model
        from genkit.generation.encoder_decoder import is_encoder_decoder

        model = as_protocol_model(model)  # a transformers model in genkit's adapter, as generate runs it
        self.model, self.tokenizer, self.engine, self.model_name = model, tokenizer, engine, model_name
        self.trust_remote_code = trust_remote_code
        self.allowed_recipes = list(allowed_recipes or [])
        self.policy = policy or ServePolicy()
        self.generation_fields = set(field_table())
        self.limits = Limits(max_model_len=max_model_len or default_max_model_len(model, tokenizer),
                             encoder_decoder=is_encoder_decoder(model))
        self.chat_template = chat_template
        self.tokenizer_info = enable_tokenizer_info_endpoint  # GET /tokenizer_info (vLLM's flag: off by default)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.created = int(time.time())
        self.shutting_down = False  # draining: /health is 503, new requests are refused
        self.inflight: set[_Group] = set()
        self.admission = Admission(max_concurrent_requests, request_timeout)  # genkit.serve.admission
        self.large_bodies = asyncio.Semaphore(_LARGE_AT_ONCE)  # /tokenize, /detokenize: _in_turn

    def cancel_inflight(self) -> None:
        """Cancel every running request (the shutdown timeout passed)."""
        for group in list(self.inflight):
            group.cancel()


# /tokenize and /detokenize take no admission slot (probes and clients that count tokens keep answering
# while the server is saturated), so their large bodies take turns instead: a tokenizer's memory grows
# with the tokens it makes (a 4 MiB body of "ab ": 1.4 million tokens, ~780 MB) and every worker thread
# (40) could hold one at once
_LARGE_BODY = 64 * 1024  # bytes
_LARGE_AT_ONCE = 2


async def _in_turn(request: HTTPRequest, state: ServerState, work: Any, *args: Any) -> Any:
    """``work(*args)`` on a worker thread; a body over ``_LARGE_BODY`` bytes waits for its turn."""
    if len(await request.body()) <= _LARGE_BODY:
        return await run_in_threadpool(work, *args)
    async with state.large_bodies:
        return await run_in_threadpool(work, *args)


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _json_body(request: HTTPRequest, state: ServerState) -> Any:
    return load_json(await request.body(), state.limits.max_json_depth)


def create_app(state: ServerState) -> Starlette:
    """The application serving ``state``'s model."""

    async def completions(request: HTTPRequest) -> Response:
        return await _handle(request, state, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await _handle(request, state, chat=True)

    async def tokenize(request: HTTPRequest) -> Response:
        return await _tokenize(request, state)

    async def detokenize(request: HTTPRequest) -> Response:
        return await _detokenize(request, state)

    routes = [
        Route("/v1/models", partial(_models, state), methods=["GET"]),
        Route("/v1/models/{model_id:path}", partial(_model, state), methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", partial(_tokenizer_info, state), methods=["GET"]),
        Route("/version", _version, methods=["GET"]),
        Route("/health", partial(_health, state), methods=["GET"]),
        Route("/metrics", partial(_metrics, state), methods=["GET"]),
    ]
    paths = [re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", r.path) for r in routes]  # /v1/models/{model_id}
    return Starlette(routes=routes, middleware=middleware(state.policy),
                     exception_handlers={HTTPException: partial(_http_error, paths)})


async def _http_error(paths: list[str], request: HTTPRequest, exc: HTTPException) -> Response:
    """Starlette's own refusals (a route that does not exist, a method a route does not take) as
    OpenAI's error object, naming what the server takes, not Starlette's plain text."""
    method, path = request.method, request.url.path[:200]
    if exc.status_code == 404:
        error = APIError(f"no route {method} {path}: this server answers {', '.join(paths)}", status=404,
                         code="not_found")
    elif exc.status_code == 405:
        allowed = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))  # Starlette's: a set's order
        error = APIError(f"{path} does not take {method}; it takes {allowed}", status=405, code="method_not_allowed",
                         headers={"Allow": allowed})
    else:
        error = APIError(exc.detail, status=exc.status_code, headers=exc.headers)
    return _error(error)


async def _models(state: ServerState, request: HTTPRequest) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "genkit",
            "max_model_len": state.limits.max_model_len}


async def _model(state: ServerState, request: HTTPRequest) -> Response:
    model_id = request.path_params["model_id"]
    if model_id != state.model_name:
        return _error(APIError(f"the model `{model_id[:100]}` does not exist; this server serves "
                               f"`{state.model_name}`", "model", 404, code="model_not_found"))
    return JSONResponse(_model_card(state))


async def _version(request: HTTPRequest) -> Response:
    import genkit

    return JSONResponse({"version": genkit.__version__})


async def _health(state: ServerState, request: HTTPRequest) -> Response:
    ok = state.engine.is_alive() and not state.shutting_down
    status = "ok" if ok else "draining" if state.shutting_down else "unavailable"
    return JSONResponse({"status": status}, status_code=200 if ok else 503)


_METRICS = {  # name: (type, help)
    "requests_total": ("counter", "Requests received."),
    "requests_running": ("gauge", "Requests generating now."),
    "requests_waiting": ("gauge", "Requests queued for an engine."),
    "requests_cancelled": ("counter", "Requests cancelled because their client went away, the server shut down or "
                                      "--request-timeout passed."),
    "requests_failed": ("counter", "Requests whose generation failed."),
    "prompt_tokens_total": ("counter", "Prompt tokens of the requests run (times their choices)."),
    "prompt_tokens_cached_total": ("counter", "Prompt tokens taken from the prompt cache instead of computed."),
    "generated_tokens_total": ("counter", "Tokens generated."),
    "generated_tokens_alone_total": ("counter", "Tokens generated by a greedy request running alone, self-speculating "
                                                "as batch-1 generate does (docs/continuous_batching.md)."),
    "cache_free_blocks": ("gauge", "Free blocks of the continuous batching engine's paged cache (cached prompt "
                                   "blocks included: an allocation takes them)."),
    "cache_prompt_blocks": ("gauge", "Free blocks that still hold a cached prompt prefix."),
    "cache_blocks": ("gauge", "Blocks of the continuous batching engine's paged cache."),
    "requests_admitted": ("gauge", "Completion requests holding a slot of --max-concurrent-requests now "
                                   "(running or waiting, on either engine)."),
    "requests_refused": ("counter", "Completion requests refused with 429: every slot was taken."),
    "requests_timed_out": ("counter", "Completion requests stopped by --request-timeout."),
    "max_concurrent_requests": ("gauge", "--max-concurrent-requests: slots for completion requests."),
}


async def _metrics(state: ServerState, request: HTTPRequest) -> Response:
    """Prometheus' text format: ``# HELP`` and ``# TYPE`` before each ``genkit_*`` sample."""
    stats = state.engine.stats
    fallback = getattr(state.engine, "fallback", None)
    if fallback is not None:  # requests the continuous engine handed to generate count too
        merged = type(stats)(**vars(stats))
        for name, value in vars(fallback.stats).items():
            if not name.startswith("cache_"):
                setattr(merged, name, getattr(merged, name) + value)
        stats = merged
    lines = []
    for name, value in [*vars(stats).items(), *state.admission.metrics().items()]:
        kind, text = _METRICS.get(name, ("gauge", name.replace("_", " ") + "."))
        lines += [f"# HELP genkit_{name} {text}", f"# TYPE genkit_{name} {kind}", f"genkit_{name} {value}"]
    lines += ["# HELP genkit_server_draining 1 while the server shuts down.", "# TYPE genkit_server_draining gauge",
              f"genkit_server_draining {int(state.shutting_down)}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "tools", "tool_choice", "add_generation_prompt",
                    "continue_final_message", "documents", "chat_template_kwargs", "chat_template"}


async def _tokenize(request: HTTPRequest, state: ServerState) -> Response:
    """vLLM's ``/tokenize``: ``prompt`` (a string) or chat ``messages`` (with their ``tools`` and
    ``tool_choice``: the prompt a chat completion renders) to token ids (on a worker thread)."""
    try:
        body = await _json_body(request, state)
        if not isinstance(body, dict) or not (isinstance(body.get("prompt"), str) or "messages" in body):
            raise APIError("`/tokenize` takes {\"prompt\": \"text\"} or {\"messages\": [...]}", "prompt")
        _check_fields(body, _TOKENIZE_FIELDS, "/tokenize", state)
        if "prompt" in body and "messages" in body:
            raise APIError("`/tokenize` takes `prompt` or `messages`, not both", "messages")
        misplaced = [name for name in ("tools", "tool_choice", "add_generation_prompt", "continue_final_message",
                                       "documents", "chat_template_kwargs", "chat_template")
                     if name in body and "messages" not in body]
        misplaced += ["add_special_tokens"] if "add_special_tokens" in body and "messages" in body else []
        if misplaced:
            other = "`prompt`" if misplaced[0] == "add_special_tokens" else "chat `messages`"
            raise APIError(f"`{misplaced[0]}` goes with {other} (the chat template adds the special tokens)",
                           misplaced[0])
        ids = await _in_turn(request, state, _tokenize_body, body, state)
    except APIError as exc:
        return _error(exc)
    return JSONResponse({"count": len(ids), "max_model_len": state.limits.max_model_len, "tokens": ids})


def _check_fields(body: dict[str, Any], fields: set[str], route: str, state: ServerState) -> None:
    """Every field of ``body`` one that ``route`` takes, and its ``model`` (optional) the served one."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(f"unknown field `{unknown[0][:100]}` for {route}; it takes {', '.join(sorted(fields))}",
                       unknown[0][:100])
    if body.get("model") is not None and body["model"] != state.model_name:
        raise APIError(f"the model `{str(body['model'])[:100]}` does not exist", "model", 404, code="model_not_found")


def _tokenize_body(body: dict[str, Any], state: ServerState) -> list[int]:
    if "messages" in body:  # the tools go into the prompt as the chat completion puts them
        # whatever its length, as vLLM's /tokenize: a client counts a prompt over the context too
        limits = dataclasses.replace(state.limits, max_model_len=None)
        return chat_prompt(body, state.tokenizer, limits, state.chat_template, parse_tools(body))
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise APIError("`add_special_tokens` must be true or false", "add_special_tokens")
    return [int(t) for t in state.tokenizer.encode(body["prompt"], add_special_tokens=special)]


async def _tokenizer_info(state: ServerState, request: HTTPRequest) -> Response:
    """vLLM's ``/tokenizer_info`` (with ``--enable-tokenizer-info-endpoint``, as vLLM's): the
    tokenizer's special tokens, the chat template the server renders with and the context, what a
    client tokenizing through ``/tokenize`` needs (lm-evaluation-harness's remote tokenizer)."""
    if not state.tokenizer_info:
        return _error(APIError("`/tokenizer_info` is off: start genkit serve with --enable-tokenizer-info-endpoint "
                               "(it shows the chat template)", status=404, code="not_found"))
    tok = state.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__,
                            "model_max_length": state.limits.max_model_len,
                            "chat_template": state.chat_template or getattr(tok, "chat_template", None)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tok, name, None)
    return JSONResponse(info)


async def _detokenize(request: HTTPRequest, state: ServerState) -> Response:
    """vLLM's ``/detokenize``: ``tokens`` (ids) to text (on a worker thread)."""
    try:
        body = await _json_body(request, state)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if isinstance(body, dict):
            _check_fields(body, {"model", "tokens"}, "/detokenize", state)
        vocab = len(state.tokenizer)
        if not is_token_ids(tokens, vocab):
            raise APIError(f"`/detokenize` takes {{\"tokens\": [ids between 0 and {vocab - 1}]}}", "tokens")
        text = await _in_turn(request, state, state.tokenizer.decode, tokens)
    except APIError as exc:
        return _error(exc)
    return JSONResponse({"prompt": text})


async def _parse_and_submit(request: HTTPRequest, state: ServerState,
                            chat: bool) -> tuple[ParsedRequest, list[RequestStream], Slot]:
    """The request admitted (its body read, a slot taken: else a 429, genkit.serve.admission), then
    checked, tokenized and handed to the engine in one call on a worker thread (tokenizing and the
    engine's settings checks can take a while: not on the event loop). The slot is given back if
    that fails; else the caller gives it back when the response ends."""
    if state.shutting_down:
        raise APIError("the server is shutting down", status=503, type_="server_error")
    arrived = time.perf_counter()
    body = await _json_body(request, state)
    slot = state.admission.admit()
    try:
        parsed, streams = await run_in_threadpool(_parse_and_submit_now, body, state, chat,
                                                  asyncio.get_running_loop(), arrived)
    except BaseException:
        slot.release()
        raise
    return parsed, streams, slot


def _parse_and_submit_now(body: Any, state: ServerState, chat: bool, loop: asyncio.AbstractEventLoop,
                          arrived: float) -> tuple[ParsedRequest, list[RequestStream]]:
    parsed = parse_request(body, chat=chat, tokenizer=state.tokenizer, model_name=state.model_name,
                           limits=state.limits, generation_fields=state.generation_fields,
                           chat_template=state.chat_template,
                           model_eos=getattr(getattr(state.model, "generation_config", None), "eos_token_id", None),
                           vocab_size=getattr(getattr(state.model, "config", None), "vocab_size", None))
    _check_custom_generate(parsed, state)
    _check_settings(parsed, body, state)
    if state.shutting_down:
        raise APIError("the server is shutting down", status=503, type_="server_error")
    parsed_at = time.perf_counter()
    kwargs = _generate_kwargs(parsed, state)
    streams = [state.engine.submit(Request(ids, parsed.best_of, kwargs, parsed.seed, parsed.engine_logprobs,
                                           f"{parsed.id}-{k}" if len(parsed.prompts) > 1 else parsed.id,
                                           parsed.engine_prompt_logprobs, parsed.max_tokens > 0), loop)
               for k, ids in enumerate(parsed.prompts)]
    streams[0].marks.update(arrived=arrived, parsed=parsed_at, submitted=time.perf_counter())
    return parsed, streams


async def _handle(request: HTTPRequest, state: ServerState, chat: bool) -> Response:
    try:
        parsed, streams, slot = await _parse_and_submit(request, state, chat)
    except APIError as exc:
        return _error(exc)
    group = _Group(streams, parsed.best_of)
    state.inflight.add(group)
    if parsed.stream:  # the response gives the slot back when it ends
        return _AdmittedStream(_sse(parsed, group, state, slot), group, state, slot)
    try:
        return await _answer(request, parsed, group, state, slot)
    finally:
        slot.release()


async def _answer(request: HTTPRequest, parsed: ParsedRequest, group: _Group, state: ServerState,
                  slot: Slot) -> Response:
    """A non-streaming response; a 504 once ``slot``'s request timeout passes (the request cancelled)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, group))
    try:
        return JSONResponse(await within(_collect(parsed, group, state), slot))
    except asyncio.TimeoutError:  # only within's own: _collect turns every failure into an APIError
        group.cancel()
        return _error(slot.timed_out())
    except asyncio.CancelledError:
        group.cancel()
        raise
    except APIError as exc:
        return _error(exc)
    finally:
        watcher.cancel()
        state.inflight.discard(group)


class _AdmittedStream(StreamingResponse):
    """The server-sent events of an admitted request. However the response ends (finished, the
    client gone before or during it, the server closing), its stream is closed, which cancels the
    request in its engine unless it finished, and its slot is given back. A send still waiting when
    the request timeout passes (the client does not read) cuts it at once (:meth:`_cut`)."""

    def __init__(self, content: AsyncGenerator[bytes, None], group: _Group, state: ServerState, slot: Slot) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.content, self.group, self.state, self.slot = content, group, state, slot

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        deadline = SendDeadline(self.slot, partial(self._cut, scope))
        try:
            await super().__call__(scope, receive, deadline.wrap(send))
        finally:
            deadline.close()
            try:
                await self.content.aclose()  # runs _sse's finally if the response was cut at one of its yields
            finally:
                if self.group in self.state.inflight:  # the client left before the stream began
                    self.state.inflight.discard(self.group)
                    self.group.cancel()
                self.slot.release()

    def _cut(self, scope: Any) -> None:
        """A send outlasted the request timeout: the request is cancelled in its engine, its slot given
        back, and its connection closed (``genkit serve``'s protocol, genkit.serve.lifecycle: the chunk
        that waits was not sent, so the stream cannot end as a timeout ends it; the client sees a
        cut connection, not a text it could take for a whole one)."""
        logger.info("request %s: its client did not read its stream until the request timeout: closing it",
                    self.group.streams[0].request.id)
        if not self.group.timed_out:
            self.group.timed_out = True
            self.slot.timed_out()
        self.state.inflight.discard(self.group)
        self.group.cancel()
        self.slot.release()
        abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
        if abort is not None:
            abort()


async def _watch_disconnect(request: HTTPRequest, group: _Group) -> None:
    """Cancel ``group`` when the client hangs up before its (non-streaming) answer is ready."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            logger.debug("a client left before its answer: cancelling")
            group.cancel()
            return


def _check_custom_generate(parsed: ParsedRequest, state: ServerState) -> None:
    """A registered strategy runs; a recipe only with ``--trust-remote-code`` and its Hub id in
    ``--allowed-recipes`` (``org/name`` allows every revision, ``org/name@rev`` that one). A
    client never names a local folder (nothing is looked up on disk for it)."""
    from genkit.plugins import get_registry

    ref = parsed.custom_generate
    if ref is None or ref in get_registry().items["strategy"]:
        return
    if state.trust_remote_code and _recipe_allowed(ref, state.allowed_recipes):
        return
    raise APIError(f"`custom_generate` {ref[:200]!r} is neither a registered strategy nor a recipe this server "
                   "allows: the operator allows recipes with `genkit serve --trust-remote-code --allowed-recipes "
                   "org/name`", "custom_generate", 403, type_="permission_error")


# generation fields an OpenAI field sets (a message naming one is about that field of the body)
_SET_BY = {"max_new_tokens": ("max_completion_tokens", "max_tokens"), "do_sample": ("temperature",),
           "num_return_sequences": ("best_of", "n"), "stop_strings": ("stop",), "sequence_bias": ("logit_bias",),
           "eos_token_id": ("stop_token_ids", "ignore_eos"), "min_new_tokens": ("min_tokens",),
           "suppress_tokens": ("allowed_token_ids",), "bad_words_ids": ("bad_words",)}


def _check_settings(parsed: ParsedRequest, body: dict[str, Any], state: ServerState) -> None:
    """The request's settings merged over the model's, as ``generate`` merges them, before anything
    is queued: a bad value is a 400 naming its field (not a failed generation, nor an error event in
    a stream that already answered 200), and beams and contrastive candidates are within the
    limits (:func:`genkit.serve.limits.check_width`). A Hub recipe reads its settings itself."""
    from genkit.generation.api import check_named_strategy, merge_config
    from genkit.plugins import get_registry

    settings = {k: v for k, v in parsed.generate_kwargs.items() if k not in ("custom_generate", "trust_remote_code")}
    recipe = parsed.custom_generate is not None and parsed.custom_generate not in get_registry().items["strategy"]
    values: Any = settings
    if not recipe:
        try:
            config, _ = merge_config(state.model, None, settings)
            if parsed.custom_generate is not None:  # a strategy named: a do_sample against it
                check_named_strategy(get_registry().get("strategy", parsed.custom_generate), config)
            _check_against_model(config, state)
        except ValueError as exc:  # ConfigError and its kin
            message = public_message(exc)
            if "logit_bias" in body and "sequence_bias" not in body:  # the client sent it as logit_bias
                message = message.replace("`sequence_bias`", "`logit_bias`")
            if "do_sample" in message and body.get("temperature") is None and settings.get("do_sample"):
                message += (" (this request samples: it sets `n` > 1 or a field that acts only when sampling, such "
                            "as `seed` or `top_p`; send `temperature: 0` to decode greedily)")
            names = [f for name in re.findall(r"`(\w+)`", message) for f in (name, *_SET_BY.get(name, ())) if f in body]
            raise APIError(message, names[0] if names else None,
                           code="not_supported" if isinstance(exc, NotSupportedError) else None) from exc
        values = {k: getattr(config, k) for k in ("num_beams", "top_k", "penalty_alpha")}
        if (config.num_beams or 1) > 1 and parsed.engine_logprobs is not None:
            raise APIError("`logprobs` cannot be reported with beam search (num_beams > 1): a token's log-probability "
                           "is its beam's, not the sequence's; drop one of them" if parsed.logprobs is not None else
                           "`best_of` > `n` ranks choices by their log-probability, which beam search (num_beams > 1) "
                           "does not report; send `n`: beam search returns its best hypotheses",
                           "logprobs" if parsed.logprobs is not None else "best_of")
    check_width(values.get("num_beams"), values.get("top_k"), values.get("penalty_alpha"), len(parsed.prompts),
                parsed.best_of, state.limits)


def _check_against_model(config: Any, state: ServerState) -> None:
    """The settings a strategy checks against the model only once it runs (a stream would have
    answered 200 by then, and the error would name no field), checked now with the strategy's own
    function: DoLa's ``dola_layers`` (layers the model has), early exit's ``assistant_early_exit``
    (fewer layers than the model's, a model that can stop after them), and what an encoder-decoder
    model cannot run (genkit.generation.api)."""
    from genkit.builtin_strategies.dola import candidate_layers
    from genkit.builtin_strategies.early_exit import exit_layer
    from genkit.generation.api import check_encoder_decoder_settings

    if state.limits.encoder_decoder:
        check_encoder_decoder_settings(config)
    if config.dola_layers is not None:
        candidate_layers(config.dola_layers, state.model)
    if config.assistant_early_exit is not None:
        exit_layer(config.assistant_early_exit, state.model)


def _recipe_allowed(ref: str, allowed: list[str]) -> bool:
    repo, _, revision = ref.partition("@")
    return ref in allowed or (repo in allowed and "/" in repo)


def _generate_kwargs(parsed: ParsedRequest, state: ServerState) -> dict[str, Any]:
    kwargs = dict(parsed.generate_kwargs)
    ref = parsed.custom_generate
    if ref is not None:
        from genkit.plugins import get_registry

        is_strategy = ref in get_registry().items["strategy"]
        # a Hub recipe is named with its revision, so that no folder of that name is looked up
        kwargs["custom_generate"] = ref if is_strategy or "@" in ref else f"{ref}@main"
        kwargs["trust_remote_code"] = None if is_strategy else True
    return kwargs


class _Group:
    """The engine requests of one HTTP request (one per prompt, each with ``width`` choices),
    read as one stream of events over all choices."""

    def __init__(self, streams: list[RequestStream], width: int) -> None:
        self.streams, self.width = streams, width
        self.timed_out = False  # stopped by the request timeout (genkit.serve.admission)

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    def release(self) -> None:
        for s in self.streams:
            s.release()

    async def events(self) -> AsyncIterator[Any]:
        """Every engine event, widened to all choices (prompt ``k``'s at ``k * width``)."""
        if len(self.streams) == 1:
            async for event in self.streams[0]:
                yield event
            return
        merged: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(k, s, merged)) for k, s in enumerate(self.streams)]
        try:
            for _ in range(len(self.streams)):
                while True:
                    item = await merged.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        break
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _pump(self, k: int, stream: RequestStream, merged: asyncio.Queue[Any]) -> None:
        total = self.width * len(self.streams)
        try:
            async for event in stream:
                merged.put_nowait(_widen(event, k * self.width, total))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            merged.put_nowait(exc)
            return
        merged.put_nowait(None)


def _widen(event: Any, offset: int, total: int) -> Any:
    if isinstance(event, PromptEvent):
        return PromptEvent(event.prompt_ids, event.scores, offset)

    def place(values: list[Any] | None) -> list[Any] | None:
        if values is None:
            return None
        out: list[Any] = [None] * total
        out[offset:offset + len(values)] = values
        return out
    return type(event)(place(event.tokens), place(event.logprobs), place(event.finish))


class _Choices:
    """Per-choice text, finish state and logprobs while events arrive (every prompt's
    ``best_of`` choices, prompt ``k``'s first at ``k * best_of``)."""

    def __init__(self, parsed: ParsedRequest, state: ServerState) -> None:
        self.parsed, self.state = parsed, state
        self.total = len(parsed.prompts) * parsed.best_of
        self.texts = [TextAssembler(state.tokenizer, parsed.stop, parsed.min_tokens, parsed.include_stop,
                                    parsed.skip_special) for _ in range(self.total)]
        self.counts = [0] * self.total
        self.finish: list[str | None] = [None] * self.total
        self.logprobs: list[list[tuple[int, float, list[tuple[int, float]]]]] = [[] for _ in range(self.total)]
        self.prompts: list[PromptEvent | None] = [None] * self.total  # each choice's prompt scored
        # each choice's echoed prompt entries in its logprobs (echo with logprobs)
        self.echoed: list[list[Any]] = [[] for _ in range(self.total)]

    def add(self, event: Any) -> list[tuple[int, str, list[tuple[int, float, list[tuple[int, float]]]]]]:
        """The new text (and its tokens' logprobs) per choice that has some. A choice finishes
        where the engine says (its finish decision, as OpenAI's ``finish_reason``) or where the
        server cut the text at a stop string. A prompt's scores (:class:`PromptEvent`) come first:
        an echoed prompt with logprobs is its choices' first text."""
        if isinstance(event, PromptEvent):
            return self._prompt(event)
        out = []
        for i, token in enumerate(event.tokens):
            reason = event.finish[i] if event.finish is not None else None
            if self.finish[i] is not None or (token is None and reason is None):
                continue
            text, new_lp = "", []
            if token is not None:
                self.counts[i] += 1
                if event.logprobs is not None and event.logprobs[i] is not None:
                    lp, alternatives = event.logprobs[i]
                    new_lp.append((token, lp, alternatives))
                    self.logprobs[i].extend(new_lp)
                text = self.texts[i].add(token, self.state.special)
            finish = "stop" if self.texts[i].stopped else openai_finish_reason(reason)
            if finish is not None:
                self.finish[i] = finish
                text += self.texts[i].flush()
            if text or new_lp:
                out.append((i, text, new_lp))
        return out

    def _prompt(self, event: PromptEvent) -> list[tuple[int, str, Any]]:
        choices = range(event.first, event.first + self.parsed.best_of)
        for i in choices:
            self.prompts[i] = event
        if not self.parsed.echo_logprobs or self.parsed.echo is None:
            return []
        entries = prompt_logprob_entries(event, self.parsed.logprobs or 0)
        for i in choices:
            self.echoed[i] = entries
        text = self.parsed.echo[event.first // self.parsed.best_of]
        return [(i, text, entries) for i in choices]

    def completion_logprobs(self, i: int) -> dict[str, Any]:
        """Choice ``i``'s completions ``logprobs``: its echoed prompt's tokens (with ``echo`` and
        ``logprobs``), then its own, whose text offsets count from the end of the echoed text."""
        parsed = self.parsed
        head = _completion_logprobs(self.state, self.echoed[i], 0)
        tail = _completion_logprobs(self.state, self.logprobs[i],
                                    0 if parsed.echo is None else len(parsed.echo[i // parsed.best_of]))
        return {k: head[k] + tail[k] for k in head}

    def close(self, cut: bool = False) -> None:
        """Every choice finished: ``"length"`` where ``max_tokens`` or (``cut``) the request timeout ended it."""
        for i in range(self.total):
            if self.finish[i] is None:
                self.finish[i] = "length" if cut or self.counts[i] >= self.parsed.max_tokens else "stop"

    def best(self) -> list[int]:
        """The choices returned: per prompt, the ``n`` of its ``best_of`` with the highest
        log-probability per token (OpenAI's ``best_of``), best first; all of them without ``best_of``."""
        width, n = self.parsed.best_of, self.parsed.n
        if width == n:
            return list(range(self.total))
        out = []
        for k in range(len(self.parsed.prompts)):
            mean = {i: sum(e[1] for e in self.logprobs[i]) / max(1, len(self.logprobs[i]))
                    for i in range(k * width, (k + 1) * width)}
            out += sorted(mean, key=lambda i: -mean[i])[:n]
        return out

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.parsed.prompts)
        completion = sum(self.counts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(state: ServerState, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
    return {"content": [logprob_entry(state.tokenizer, t, lp, alt) for t, lp, alt in entries]}


def _completion_logprobs(state: ServerState, entries: list[Any], offset: int) -> dict[str, Any]:
    """Completions' ``logprobs`` of ``entries`` (token, log-probability, alternatives); an echoed
    prompt's first token has neither (``null``)."""
    tokens = [state.tokenizer.decode([t]) for t, _, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else finite_logprob(lp) for _, lp, _ in entries],
            "top_logprobs": [None if alt is None else {state.tokenizer.decode([t]): finite_logprob(v) for t, v in alt}
                             for _, _, alt in entries],
            "text_offset": offsets}


def _failure(exc: Exception) -> APIError:
    bad_input = isinstance(exc, ValueError)
    return APIError(f"generation failed: {public_message(exc)}", status=400 if bad_input else 500,
                    type_="invalid_request_error" if bad_input else "server_error")


async def _collect(parsed: ParsedRequest, group: _Group, state: ServerState) -> dict[str, Any]:
    choices = _Choices(parsed, state)
    try:
        async for event in group.events():
            choices.add(event)
            if all(f is not None for f in choices.finish):
                group.release()  # a stop string ended every choice: the engine may stop
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - this request failed (the engine goes on)
        raise _failure(exc) from exc
    choices.close()
    out = []
    for index, i in enumerate(choices.best()):
        text = choices.texts[i].text
        if parsed.echo is not None:
            text = parsed.echo[i // parsed.best_of] + text
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = (_chat_logprobs(state, choices.logprobs[i]) if parsed.chat
                        else choices.completion_logprobs(i))
        if parsed.chat:
            message, finish = ({"role": "assistant", "content": text}, choices.finish[i]) if parsed.tools is None \
                else parsed.tools.message(text, choices.finish[i])  # genkit.serve.tools
            out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": choices.finish[i],
                        **_prompt_logprobs(parsed, choices, i, state)})
    answer = {"id": parsed.id, "object": "chat.completion" if parsed.chat else "text_completion",
              "created": parsed.created, "model": state.model_name, "choices": out, "usage": choices.usage()}
    if parsed.chat:  # vLLM's chat answers them beside the choices (one prompt)
        answer.update(_prompt_logprobs(parsed, choices, 0, state))
    return answer


def _prompt_logprobs(parsed: ParsedRequest, choices: _Choices, i: int, state: ServerState) -> dict[str, Any]:
    """vLLM's ``prompt_logprobs`` of choice ``i``'s prompt, as a field of the answer; none unless asked for."""
    event = choices.prompts[i]
    if parsed.prompt_logprobs is None or event is None:
        return {}
    return {"prompt_logprobs": vllm_prompt_logprobs(state.tokenizer, event, parsed.prompt_logprobs)}


def _event(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _until_timeout(group: _Group, slot: Slot) -> AsyncIterator[Any]:
    """``group``'s events until ``slot``'s request timeout; then the request is cancelled in its
    engine (``group.timed_out``) and the events end."""
    events = group.events()
    if slot.deadline is None:
        async for event in events:
            yield event
        return
    while True:
        try:
            event = await within(events.__anext__(), slot)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            group.timed_out = True
            group.cancel()
            slot.timed_out()
            return
        yield event


async def _sse(parsed: ParsedRequest, group: _Group, state: ServerState, slot: Slot) -> AsyncIterator[bytes]:
    """Server-sent events of a streaming response; the request is cancelled if the client leaves,
    and ends with ``finish_reason`` ``"length"`` at the request timeout."""
    choices = _Choices(parsed, state)
    kind = "chat.completion.chunk" if parsed.chat else "text_completion"
    head = {"id": parsed.id, "object": kind, "created": parsed.created, "model": state.model_name}
    offsets = [0] * choices.total
    tool_streams = None if parsed.tools is None else [ToolStream(parsed.tools) for _ in range(choices.total)]
    render = None if parsed.logprobs is None else partial(_chat_logprobs, state)

    def chunks(i: int, text: str, entries: Any, finish: str | None) -> list[dict[str, Any]]:
        if tool_streams is not None:  # genkit.serve.tools: content, or tool_calls deltas
            return tool_streams[i].chunks(i, text, finish, entries, render)
        return [_chunk(parsed, state, i, text, entries, offsets, finish)]

    first = True
    completed = False
    try:
        for i, text in _opening(parsed, choices.total):
            yield _event({**head, "choices": [_chunk(parsed, state, i, text, [], offsets, None, opening=True)]})
            offsets[i] += len(text)
        try:
            async for event in _until_timeout(group, slot):
                was_open = [f is None for f in choices.finish]
                for i, text, entries in choices.add(event):
                    if first and text and not isinstance(event, PromptEvent):
                        first = False
                        _log_first_token(parsed, group)
                    for c in chunks(i, text, entries, None):
                        yield _event({**head, "choices": [c]})
                    offsets[i] += len(text)
                for i, open_ in enumerate(was_open):
                    if open_ and choices.finish[i] is not None:
                        for c in chunks(i, "", [], choices.finish[i]):
                            yield _event({**head, "choices": [c]})
                if all(f is not None for f in choices.finish):
                    group.release()
        except Exception as exc:  # noqa: BLE001 - report the failure in the stream, then end it
            yield _event(_failure(exc).body())
        else:
            before = list(choices.finish)
            choices.close(cut=group.timed_out)
            for i, f in enumerate(before):
                if f is None:
                    for c in chunks(i, "", [], choices.finish[i]):
                        yield _event({**head, "choices": [c]})
            if parsed.include_usage:
                yield _event({**head, "choices": [], "usage": choices.usage()})
        completed = True
        yield b"data: [DONE]\n\n"
    finally:
        logger.debug("request %s: stream closed (%s)", parsed.id, "completed" if completed else "client left")
        state.inflight.discard(group)
        if completed:
            group.release()
        else:
            group.cancel()  # the client went away mid-stream


def _opening(parsed: ParsedRequest, total: int) -> list[tuple[int, str]]:
    """The first chunk of each choice: chat's role, or the echoed prompt."""
    if parsed.chat:
        return [(i, "") for i in range(total)]
    if parsed.echo is not None and not parsed.echo_logprobs:  # with logprobs: once the prompt is scored
        return [(i, parsed.echo[i // parsed.best_of]) for i in range(total)]
    return []


def _chunk(parsed: ParsedRequest, state: ServerState, i: int, text: str,
           entries: list[tuple[int, float, list[tuple[int, float]]]], offsets: list[int],
           finish: str | None, opening: bool = False) -> dict[str, Any]:
    logprobs = None
    if parsed.logprobs is not None and entries:
        logprobs = (_chat_logprobs(state, entries) if parsed.chat
                    else _completion_logprobs(state, entries, offsets[i]))
    if parsed.chat:
        delta: dict[str, Any] = {"content": text} if text or finish is None else {}
        if opening:
            delta = {"role": "assistant", "content": ""}
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _log_first_token(parsed: ParsedRequest, group: _Group) -> None:
    """At debug level: where the time to ``parsed``'s first text went, from the marks its engine
    request collected (:attr:`genkit.serve.engine.RequestStream.marks`): arrived (the route ran),
    parsed (body checked and tokenized), queued (the engine's request made), submitted, step (the
    step that computed its prompt began), chosen (its first token), routed (handed to the event
    loop), sent (its chunk goes to the socket)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    marks = sorted({**group.streams[0].marks, "sent": time.perf_counter()}.items(), key=lambda m: m[1])
    steps = ", ".join(f"{name} +{(t - prev) * 1e3:.1f}" for (_, prev), (name, t) in zip(marks, marks[1:]))
    logger.debug("request %s: first text %.1f ms after %s (%s ms)", parsed.id, (marks[-1][1] - marks[0][1]) * 1e3,
                 marks[0][0], steps)
