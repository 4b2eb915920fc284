"""The server's engines: continuous batching for what it can run, ``generate`` for the rest.

:class:`ContinuousEngine` hands each request's ``n`` choices to a
:class:`~genkit.continuous.ContinuousBatchingManager` as streaming requests, and a dispatcher
thread routes the manager's outputs to the requests' streams, with the manager's log-probabilities
and finish reasons. A request it cannot run (what the continuous batching gate,
:mod:`genkit.continuous.gate`, refuses: beam search, contrastive search, DoLa, guidance,
watermarking, a recipe or a strategy by name...) goes to the
:class:`~genkit.serve.engine.GenerateEngine` beside it, one at a time. A request's prompt
log-probabilities come from its first choice's steps; the other choices' tokens are held until
they are out (the echoed prompt leads every choice's text).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any

from ..errors import ConfigError, NotSupportedError
from .engine import EngineStats, GenerateEngine, PromptEvent, Request, RequestStream, TokenEvent, push_all

logger = logging.getLogger("genkit.serve")

__all__ = ["ContinuousEngine", "make_engine"]


class ContinuousEngine:
    name = "continuous batching"

    def __init__(self, model: Any, tokenizer: Any, *, scheduler: str | None = None,
                 max_batch_tokens: int | None = None, prompt_cache: bool = True) -> None:
        from genkit.continuous import ContinuousBatchingConfig

        cb: dict[str, Any] = {} if prompt_cache else {"allow_block_sharing": False}
        if scheduler is not None:
            cb["scheduler_type"] = scheduler
        if max_batch_tokens is not None:
            cb["max_batch_tokens"] = max_batch_tokens
        self.manager = model.init_continuous_batching(
            continuous_batching_config=ContinuousBatchingConfig(**cb) if cb else None)
        self.fallback = GenerateEngine(model, tokenizer)
        self.stats = EngineStats()
        self.stats.cache_blocks = self.manager.cache.num_blocks
        self._routes: dict[str, tuple[RequestStream, int]] = {}
        self._open: dict[int, list[bool]] = {}
        # a scored request's events of choices but the first, held until the first's prompt scores are out
        self._held: dict[int, list[tuple[RequestStream, Any]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.manager.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="genkit-serve-dispatch", daemon=True)
        self._thread.start()

    def warm_up(self, prompt_ids: list[int], new_tokens: int = 4, timeout: float = 300.0) -> float | None:
        """One greedy request of ``prompt_ids`` through the manager before the server takes any, as
        llama-server warms up: the first steps' costs (the kernels' thread pools and scratch memory,
        the prompt's and the decode step's first calls, a lone request's draft) are paid here, not by
        the first client (the demo model in float32: a first request's first text 385 ms after it was
        sent without it, 59 ms with it; 8-12 ms for the next ones; docs/serve.md). Its tokens go
        nowhere (no route), its prompt stays in the prompt cache. The seconds it took, or None when
        it did not finish within ``timeout``."""
        done = threading.Event()
        rid = f"genkit-warm-up-{next(self._ids)}"
        self.manager.register_result_handler(rid, lambda out: done.set() if out.is_finished() else None)
        start = time.perf_counter()
        self.manager.add_request(list(prompt_ids), request_id=rid, max_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start if done.wait(timeout) else None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop) -> RequestStream:
        """``request`` on the manager, or on the generate engine when the manager's gate
        (:mod:`genkit.continuous.gate`) refuses its settings: the manager merges them once and
        raises that refusal, queueing nothing. Stop strings are the server's own (it cuts the
        text and releases the request there). A request's prompt is scored (prompt
        log-probabilities) by the steps that compute its first choice's; a prompt only scored
        (``generate`` False) is one manager request that chooses no token (``max_new_tokens`` 0)."""
        stream = RequestStream(request, loop)
        rids = [f"srv{next(self._ids)}" for _ in range(request.n if request.generate else 1)]
        self._open_routes(stream, rids)
        try:
            self._add(stream, rids)
        except NotSupportedError as exc:
            self._close_routes(stream, rids)
            logger.debug("request %s on the generate engine: %s", request.id, exc)
            return self.fallback.submit(request, loop)
        except BaseException:  # the manager's queue is full, or it stopped: nothing of it stays
            self._close_routes(stream, rids)
            raise
        return stream

    def _open_routes(self, stream: RequestStream, rids: list[str]) -> None:
        request = stream.request
        with self._lock:
            self.stats.requests_total += 1
            self.stats.requests_running += 1
            self.stats.prompt_tokens_total += len(request.prompt_ids) * len(rids)
            self._open[id(stream)] = [True] * len(rids)
            if request.prompt_logprobs is not None and len(rids) > 1:
                self._held[id(stream)] = []
            for i, rid in enumerate(rids):
                self._routes[rid] = (stream, i)

    def _close_routes(self, stream: RequestStream, rids: list[str]) -> None:
        """Undo :meth:`_open_routes` for a request the manager did not queue (refused, or it could not)."""
        request = stream.request
        with self._lock:
            self.stats.requests_total -= 1
            self.stats.requests_running -= 1
            self.stats.prompt_tokens_total -= len(request.prompt_ids) * len(rids)
            self._open.pop(id(stream), None)
            self._held.pop(id(stream), None)
            for rid in rids:
                self._routes.pop(rid, None)

    def _add(self, stream: RequestStream, rids: list[str]) -> None:
        """The request's choices on the manager; a refusal (the same settings for every choice, so
        the first) or another error cancels the choices already added and is raised."""
        request = stream.request
        kwargs = dict(request.generate_kwargs)
        max_new = kwargs.pop("max_new_tokens", None)
        if not request.generate:  # the prompt only scored: no token chosen
            max_new = 0
        kwargs.pop("stop_strings", None)  # the server cuts the text and releases the request there

        def cancel() -> None:
            for rid in rids:
                self.manager.cancel_request(rid)
        stream.on_cancel = cancel
        for i, rid in enumerate(rids):
            seed = None if request.seed is None else request.seed + i
            timed = i == 0 and logger.isEnabledFor(logging.DEBUG)  # the first token's way, logged by the app
            try:
                self.manager.add_request(request.prompt_ids, request_id=rid, max_new_tokens=max_new, streaming=True,
                                         record_timestamps=timed, top_logprobs=request.logprobs, raise_refusal=True,
                                         prompt_logprobs=request.prompt_logprobs if i == 0 else None,
                                         **({"seed": seed} if seed is not None else {}),
                                         tokenizer=self.fallback.tokenizer, **kwargs)  # for structured outputs
            except BaseException:
                for added in rids[:i]:
                    self.manager.cancel_request(added)
                raise

    def _dispatch(self) -> None:
        sent: dict[str, int] = {}
        while not self._stop.is_set():
            outs = self.manager.output_router.take_all(timeout=0.1)  # a step's outputs at once
            self.stats.cache_free_blocks = self.manager.cache.free_blocks
            self.stats.cache_prompt_blocks = self.manager.cache.cached_blocks
            self.stats.prompt_tokens_cached_total = self.manager.reused_prompt_tokens
            self.stats.generated_tokens_alone_total = self.manager.solo.tokens
            pushes: list[tuple[RequestStream, Any]] = []
            for out in outs:
                self._route(out, sent, pushes)
            push_all(pushes)  # one wake-up of the event loop for the whole step

    def _route(self, out: Any, sent: dict[str, int], pushes: list[tuple[RequestStream, Any]]) -> None:
        """The events of one manager output for its request's stream, added to ``pushes``."""
        from genkit.continuous import RequestStatus

        with self._lock:
            route = self._routes.get(out.request_id)
        if route is None:
            return
        stream, choice = route
        start = sent.get(out.request_id, 0)
        if start == 0 and out.generated_tokens and not stream.marks.get("routed"):
            _mark_first(stream, out)
        sent[out.request_id] = len(out.generated_tokens)
        if out.status != RequestStatus.FAILED:
            self.stats.generated_tokens_total += len(out.generated_tokens) - start
            with self._lock:
                if start == 0 and out.prompt_logprobs is not None:  # the prompt's scores before its first token,
                    pushes.append((stream, PromptEvent(list(out.prompt_ids), out.prompt_logprobs)))
                    pushes += self._held.pop(id(stream), [])  # then the other choices' tokens held until now
                held = self._held.get(id(stream))
            (held if held is not None else pushes).extend(
                (stream, event) for event in _events(out, start, choice, stream.request))
        if not out.is_finished():
            return
        sent.pop(out.request_id, None)
        with self._lock:
            self._routes.pop(out.request_id, None)
            still = self._open.get(id(stream))
            if still is None:
                return
            still[choice] = False
            failed = out.status == RequestStatus.FAILED and out.error != "cancelled"
            if failed or not any(still):
                del self._open[id(stream)]
                self._held.pop(id(stream), None)
                self.stats.requests_running -= 1
                self.stats.requests_cancelled += stream.client_cancelled
                self.stats.requests_failed += failed
        if failed:
            pushes.append((stream, ValueError(out.error)))
        elif not any(still):
            pushes.append((stream, None))

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.manager.is_running() and self.fallback.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        self.manager.stop(block=True, timeout=timeout)
        self._stop.set()
        self._thread.join(timeout)
        self.fallback.shutdown(timeout)


def _events(out: Any, start: int, choice: int, request: Request) -> list[TokenEvent]:
    """The manager's tokens from ``start`` on as events of choice ``choice``, with their
    log-probabilities when asked for, and the finish reason on the last token of a finished one."""
    events = []
    for k in range(start, len(out.generated_tokens)):
        tokens: list[int | None] = [None] * request.n
        tokens[choice] = out.generated_tokens[k]
        logprobs: list[Any] | None = None
        if request.logprobs is not None:
            logprobs = [None] * request.n
            logprobs[choice] = (out.logprobs[k], out.top_logprobs[k] if k < len(out.top_logprobs) else [])
        finish: list[str | None] = [None] * request.n
        if k == len(out.generated_tokens) - 1 and out.is_finished():
            finish[choice] = out.finish_reason
        events.append(TokenEvent(tokens, logprobs, finish))
    return events


def make_engine(model: Any, tokenizer: Any, *, scheduler: str | None = None,
                max_batch_tokens: int | None = None, prompt_cache: bool = True) -> Any:
    """Continuous batching for a native Llama-family model, else ``generate`` one request at a time
    (which computes every prompt in full): an encoder-decoder model (T5, BART...) runs there, its
    prompt the encoder's input. ``prompt_cache=False``: continuous batching computes every prompt
    in full too (``allow_block_sharing=False``)."""
    from genkit.continuous.gate import model_refusal
    from genkit.models.paged import require_paged

    try:
        why = model_refusal(model)
        if why is not None:
            raise NotSupportedError(why)
        require_paged(model)
    except NotSupportedError as exc:
        if scheduler is not None or max_batch_tokens is not None:
            raise ConfigError(f"--scheduler and --max-batch-tokens need continuous batching: {exc}") from exc
        logger.info("serving with the generate engine: %s", exc)
        return GenerateEngine(model, tokenizer)
    return ContinuousEngine(model, tokenizer, scheduler=scheduler, max_batch_tokens=max_batch_tokens,
                            prompt_cache=prompt_cache)


def _mark_first(stream: RequestStream, out: Any) -> None:
    """The manager's times of a request's first token on its stream (``RequestStream.marks``)."""
    stream.marks.update(queued=out.created_time, step=out.lifespan[0], routed=time.perf_counter())
    if out.timestamps:
        stream.marks["chosen"] = out.timestamps[0]
