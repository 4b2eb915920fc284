"""The ASGI application of ``genkit serve`` (Starlette): OpenAI's completions and chat completions,
models, health and metrics.

Streaming responses are server-sent events (``data: {json}``, then ``data: [DONE]``). A client
that disconnects cancels its request: Starlette stops the response's generator, whose ``finally``
cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from genkit.strategy import openai_finish_reason

from .engine import Request, RequestStream
from .openai_api import APIError, ParsedRequest, TextAssembler, logprob_entry, parse_request
from .tools import ToolStream

logger = logging.getLogger("genkit.serve")

__all__ = ["ServerState", "create_app"]


class ServerState:
    """What the routes share: the model's name, tokenizer, engine, and the server's policy."""

    def __init__(self, model: Any, tokenizer: Any, engine: Any, model_name: str, *,
                 trust_remote_code: bool = False) -> None:
        from genkit.config import field_table

        self.model, self.tokenizer, self.engine, self.model_name = model, tokenizer, engine, model_name
        self.trust_remote_code = trust_remote_code
        self.generation_fields = set(field_table())
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.created = int(time.time())
        self.shutting_down = False


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _body(request: HTTPRequest) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from exc


def create_app(state: ServerState) -> Starlette:
    """The application serving ``state``'s model."""

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "genkit"}]})

    async def health(request: HTTPRequest) -> Response:
        ok = state.engine.is_alive() and not state.shutting_down
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def metrics(request: HTTPRequest) -> Response:
        stats = state.engine.stats
        fallback = getattr(state.engine, "fallback", None)
        if fallback is not None:  # requests the continuous engine handed to generate count too
            merged = type(stats)(**vars(stats))
            for name, value in vars(fallback.stats).items():
                if not name.startswith("cache_"):
                    setattr(merged, name, getattr(merged, name) + value)
            stats = merged
        lines = [f"genkit_{name} {value}" for name, value in vars(stats).items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def completions(request: HTTPRequest) -> Response:
        return await _handle(request, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await _handle(request, chat=True)

    async def _handle(request: HTTPRequest, chat: bool) -> Response:
        try:
            if state.shutting_down:
                raise APIError("the server is shutting down", status=503, type_="server_error")
            body = await _body(request)
            parsed = parse_request(body, chat=chat, tokenizer=state.tokenizer, model_name=state.model_name,
                                   max_positions=state.max_positions, generation_fields=state.generation_fields)
            _check_custom_generate(parsed, state)
        except APIError as exc:
            return _error(exc)
        stream = state.engine.submit(
            Request(parsed.prompt_ids, parsed.n, _generate_kwargs(parsed, state), parsed.seed, parsed.logprobs, parsed.id),
            asyncio.get_running_loop())
        if parsed.stream:
            return StreamingResponse(_sse(parsed, stream, state), media_type="text/event-stream")
        try:
            return JSONResponse(await _collect(parsed, stream, state))
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except APIError as exc:
            return _error(exc)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)


def _check_custom_generate(parsed: ParsedRequest, state: ServerState) -> None:
    """A registered strategy runs; a recipe only as the operator allows: any with
    ``--trust-remote-code``, otherwise a Hub recipe that a trusted-repos entry covers (the loader
    checks the entry again against the commit). A client never gets a local folder run without
    the flag."""
    from genkit.errors import UnknownItemError
    from genkit.recipes.reference import classify
    from genkit.recipes.trust import could_be_trusted

    ref = parsed.custom_generate
    if ref is None:
        return
    try:
        named = classify(ref)
    except UnknownItemError as exc:  # not a strategy, a folder or a Hub id: the error lists the strategies
        raise APIError(str(exc), "custom_generate") from exc
    except ValueError as exc:  # a path that does not exist, a bad revision: said only to a trusting operator's
        if state.trust_remote_code:  # clients (others learn nothing about the server's folders)
            raise APIError(str(exc), "custom_generate") from exc
        named = None
    if named is not None and (not named.is_recipe or state.trust_remote_code):
        return
    if named is None or named.recipe is None or named.kind == "local" or not could_be_trusted(named.recipe, None):
        raise APIError(f"`custom_generate` {ref!r} is a recipe this server does not trust: the operator allows "
                       "recipes with `genkit serve --trust-remote-code` or a trusted-repos entry",
                       "custom_generate", 403, type_="permission_error")


def _generate_kwargs(parsed: ParsedRequest, state: ServerState) -> dict[str, Any]:
    kwargs = dict(parsed.generate_kwargs)
    if parsed.custom_generate is not None:
        kwargs["custom_generate"] = parsed.custom_generate
        kwargs["trust_remote_code"] = True if state.trust_remote_code else None
    return kwargs


class _Choices:
    """Per-choice text, finish state and logprobs while events arrive."""

    def __init__(self, parsed: ParsedRequest, state: ServerState) -> None:
        self.parsed, self.state = parsed, state
        self.texts = [TextAssembler(state.tokenizer, parsed.stop) for _ in range(parsed.n)]
        self.counts = [0] * parsed.n
        self.finish: list[str | None] = [None] * parsed.n
        self.logprobs: list[list[tuple[int, float, list[tuple[int, float]]]]] = [[] for _ in range(parsed.n)]

    def add(self, event: Any) -> list[tuple[int, str, list[tuple[int, float, list[tuple[int, float]]]]]]:
        """The new text (and its tokens' logprobs) per choice that has some. A choice finishes
        where the engine says (its finish decision, as OpenAI's ``finish_reason``) or where the
        server cut the text at a stop string."""
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

    def close(self) -> None:
        for i in range(self.parsed.n):
            if self.finish[i] is None:
                self.finish[i] = "length" if self.counts[i] >= self.parsed.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        prompt = len(self.parsed.prompt_ids)
        completion = sum(self.counts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_logprobs(state: ServerState, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict[str, Any]:
    return {"content": [logprob_entry(state.tokenizer, t, lp, alt) for t, lp, alt in entries]}


def _completion_logprobs(state: ServerState, entries: list[tuple[int, float, list[tuple[int, float]]]],
                         offset: int) -> dict[str, Any]:
    tokens = [state.tokenizer.decode([t]) for t, _, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{state.tokenizer.decode([t]): v for t, v in alt} for _, _, alt in entries],
            "text_offset": offsets}


async def _collect(parsed: ParsedRequest, stream: RequestStream, state: ServerState) -> dict[str, Any]:
    choices = _Choices(parsed, state)
    try:
        async for event in stream:
            choices.add(event)
            if all(f is not None for f in choices.finish):
                stream.release()  # a stop string ended every choice: the engine may stop
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - this request failed (the engine goes on)
        raise APIError(f"generation failed: {exc}", status=400 if isinstance(exc, ValueError) else 500,
                       type_="invalid_request_error" if isinstance(exc, ValueError) else "server_error") from exc
    choices.close()
    out = []
    for i in range(parsed.n):
        text = choices.texts[i].text
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = (_chat_logprobs(state, choices.logprobs[i]) if parsed.chat
                        else _completion_logprobs(state, choices.logprobs[i], 0))
        if parsed.chat:
            message, finish = ({"role": "assistant", "content": text}, choices.finish[i]) if parsed.tools is None \
                else parsed.tools.message(text, choices.finish[i])  # genkit.serve.tools
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            out.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": choices.finish[i]})
    return {"id": parsed.id, "object": "chat.completion" if parsed.chat else "text_completion",
            "created": parsed.created, "model": state.model_name, "choices": out, "usage": choices.usage()}


def _event(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def _sse(parsed: ParsedRequest, stream: RequestStream, state: ServerState) -> AsyncIterator[bytes]:
    """Server-sent events of a streaming response; the request is cancelled if the client leaves."""
    choices = _Choices(parsed, state)
    kind = "chat.completion.chunk" if parsed.chat else "text_completion"
    head = {"id": parsed.id, "object": kind, "created": parsed.created, "model": state.model_name}
    offsets = [0] * parsed.n
    tool_streams = None if parsed.tools is None else [ToolStream(parsed.tools) for _ in range(parsed.n)]

    def chunks(i: int, text: str, entries: Any, finish: str | None) -> list[dict[str, Any]]:
        if tool_streams is not None:  # genkit.serve.tools: content, or tool_calls deltas
            return tool_streams[i].chunks(i, text, finish)
        return [_chunk(parsed, state, i, text, entries, offsets, finish)]

    completed = False
    try:
        if parsed.chat:
            yield _event({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None} for i in range(parsed.n)]})
        try:
            async for event in stream:
                was_open = [f is None for f in choices.finish]
                for i, text, entries in choices.add(event):
                    for c in chunks(i, text, entries, None):
                        yield _event({**head, "choices": [c]})
                    offsets[i] += len(text)
                for i, open_ in enumerate(was_open):
                    if open_ and choices.finish[i] is not None:
                        for c in chunks(i, "", [], choices.finish[i]):
                            yield _event({**head, "choices": [c]})
                if all(f is not None for f in choices.finish):
                    stream.release()
        except Exception as exc:  # noqa: BLE001 - report the failure in the stream, then end it
            error = APIError(f"generation failed: {exc}", type_="server_error", status=500)
            yield _event(error.body())
        else:
            before = list(choices.finish)
            choices.close()
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
        if completed:
            stream.release()
        else:
            stream.cancel()  # the client went away mid-stream


def _chunk(parsed: ParsedRequest, state: ServerState, i: int, text: str,
           entries: list[tuple[int, float, list[tuple[int, float]]]], offsets: list[int],
           finish: str | None) -> dict[str, Any]:
    logprobs = None
    if parsed.logprobs is not None and entries:
        logprobs = (_chat_logprobs(state, entries) if parsed.chat
                    else _completion_logprobs(state, entries, offsets[i]))
    if parsed.chat:
        delta = {"content": text} if text or finish is None else {}
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
