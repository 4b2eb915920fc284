"""The server's generation engine: requests in, token events out, from a worker thread.

:class:`GenerateEngine` runs each request with :func:`genkit.generate` on one worker thread, one
request (with its ``n`` choices as one batch) at a time. Tokens reach the request's
:class:`RequestStream` as they are chosen (an ``asyncio`` queue fed with
``loop.call_soon_threadsafe``), with their log-probabilities when asked. Cancelling a request (a
client that went away) stops its generation at the next step; a request still queued never starts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from genkit.errors import ConfigError

logger = logging.getLogger("genkit.serve")

__all__ = ["EngineStats", "GenerateEngine", "Request", "RequestStream", "TokenEvent"]


@dataclass
class Request:
    """One generation: ``prompt_ids`` (a list of token ids), ``n`` choices, the keyword arguments
    for ``genkit.generate`` (``max_new_tokens``, sampling fields, ``stop_strings``, ...), a seed,
    and how many log-probabilities to report per token (``None``: none)."""

    prompt_ids: list[int]
    n: int = 1
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None
    id: str = ""


@dataclass
class TokenEvent:
    """Tokens chosen at one step: ``tokens[i]`` for choice ``i`` (``None`` once it has finished);
    ``logprobs[i]`` = (the token's log-probability, [(token id, log-probability), ...] best first)."""

    tokens: list[int | None]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


class RequestStream:
    """The events of one request, read with ``async for`` in the server's event loop. The last
    item is ``None`` (finished) or an exception (the request failed)."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()  # stop generating (the client left, or needs no more)
        self.client_cancelled = False  # the client left before the end (counted in the metrics)
        self.on_cancel: Any = None  # set by an engine that must act at once (continuous batching)

    def push(self, item: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def cancel(self) -> None:
        """The client went away: stop, and count the request as cancelled."""
        self.client_cancelled = True
        self.release()

    def release(self) -> None:
        """The client has all it wants (a stop string, every choice finished): stop generating."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]


@dataclass
class EngineStats:
    """Counters for ``/metrics``."""

    requests_total: int = 0
    requests_running: int = 0
    requests_waiting: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    cache_free_blocks: int = 0
    cache_blocks: int = 0


class _Stop:
    """A stopping criterion that ends a generation whose request was cancelled."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stream.cancelled.is_set(), dtype=torch.bool)


class _Recorder:
    """The last logits processor: keeps each step's log-probabilities, so that the streamer can
    report the chosen token's and the best alternatives'."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores


class _Streamer:
    """Receives the chosen tokens from ``generate`` and pushes :class:`TokenEvent` items."""

    def __init__(self, stream: RequestStream, rows: int, eos: set[int], recorder: _Recorder | None,
                 stats: EngineStats) -> None:
        self.stream, self.rows, self.eos, self.recorder, self.stats = stream, rows, eos, recorder, stats
        self.prompt_seen = False
        self.done = [False] * rows

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate streams the prompt first
            self.prompt_seen = True
            return
        ids = value.reshape(-1).tolist()
        tokens: list[int | None] = []
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = [] if self.recorder else None
        for row, tok in enumerate(ids):
            if self.done[row]:
                tokens.append(None)
                if logprobs is not None:
                    logprobs.append(None)
                continue
            tokens.append(int(tok))
            self.stats.generated_tokens_total += 1
            if tok in self.eos:
                self.done[row] = True
            if logprobs is not None and self.recorder is not None and self.recorder.last is not None:
                lp = self.recorder.last[row]
                top = lp.topk(self.recorder.k) if self.recorder.k else None
                alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))
                logprobs.append((float(lp[tok]), alternatives))
        self.stream.push(TokenEvent(tokens, logprobs))

    def end(self) -> None:
        pass


class GenerateEngine:
    """Runs requests on ``model`` one at a time on a worker thread (see the module docstring)."""

    name = "generate"

    def __init__(self, model: Any, tokenizer: Any, max_queue: int = 0) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stats = EngineStats()
        self._queue: queue.Queue[RequestStream | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="genkit-serve-engine", daemon=True)
        self._lock = threading.Lock()
        self._thread.start()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> RequestStream:
        stream = RequestStream(request, loop)
        with self._lock:
            self.stats.requests_total += 1
            self.stats.requests_waiting += 1
        self._queue.put(stream)
        return stream

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop after the running request; requests still queued are cancelled."""
        pending = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                pending.append(item)
        for stream in pending:
            stream.cancel()
            stream.push(RuntimeError("the server is shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            stream = self._queue.get()
            if stream is None:
                return
            with self._lock:
                self.stats.requests_waiting -= 1
            if stream.cancelled.is_set():
                with self._lock:
                    self.stats.requests_cancelled += stream.client_cancelled
                stream.push(None)
                continue
            with self._lock:
                self.stats.requests_running += 1
            try:
                self._generate(stream)
                stream.push(None)
            except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
                logger.warning("request %s failed: %s", stream.request.id, exc)
                with self._lock:
                    self.stats.requests_failed += 1
                stream.push(exc)
            finally:
                with self._lock:
                    self.stats.requests_running -= 1
                    self.stats.requests_cancelled += stream.client_cancelled

    def _generate(self, stream: RequestStream) -> None:
        import genkit

        request = stream.request
        kwargs = dict(request.generate_kwargs)
        recorder = _Recorder(request.logprobs) if request.logprobs is not None else None
        eos = kwargs.get("eos_token_id", self.model.generation_config.eos_token_id)
        eos_set = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        streams = _streams(self.model, kwargs)
        if not streams and recorder is not None:
            raise ConfigError("`logprobs` cannot be reported with beam search (num_beams > 1): a token's "
                              "log-probability is its beam's, not the sequence's; drop one of them")
        streamer = _Streamer(stream, request.n, eos_set, recorder, self.stats)
        ids = torch.tensor([request.prompt_ids])
        self.stats.prompt_tokens_total += len(request.prompt_ids) * request.n
        if request.seed is not None:
            torch.manual_seed(request.seed)
        if request.n > 1:
            kwargs["num_return_sequences"] = request.n
        with torch.no_grad():
            out = genkit.generate(self.model, ids, tokenizer=self.tokenizer, streamer=streamer if streams else None,
                                  stopping_criteria=[_Stop(stream)],
                                  logits_processor=[recorder] if recorder is not None else None, **kwargs)
        if not streams:  # the best hypotheses are known at the end: emit them now, as if streamed
            sequences = out.sequences if hasattr(out, "sequences") else out
            streamer.put(ids)
            for column in sequences[:, ids.shape[1]:].T:
                if all(streamer.done):
                    break
                streamer.put(column)


def _streams(model: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``generate`` runs these settings with a streamer: beam search knows its tokens only
    at the end (its rows are hypotheses that change until then)."""
    from genkit.generation.api import merge_config

    settings = {k: v for k, v in kwargs.items() if k not in ("custom_generate", "trust_remote_code")}
    try:
        config, _ = merge_config(model, None, settings)
    except ValueError:  # a recipe's own settings, or a bad one: generate reports it
        return True
    return int(config.num_beams or 1) == 1
