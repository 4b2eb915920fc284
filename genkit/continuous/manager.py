"""``ContinuousBatchingManager``: a background thread that batches requests step by step.

Requests arrive through :meth:`add_request` from any thread; the loop schedules a step
(:mod:`~genkit.continuous.scheduler`), runs it (the model's paged forward, :mod:`genkit.models.paged`),
chooses each request's next token with its own logits processors and random generator, and
publishes outputs: every token for a streaming request, the final output otherwise. A request that
fails (a bad token id, a processor that raises) fails alone; the loop goes on with the others.
Names and semantics follow transformers 5's ``ContinuousBatchingManager`` (5.24, the installed
reference): ``pause``, ``warmup``, ``register_result_handler``, ``join(stop_trigger_time, timeout)``.

The requests themselves (waiting, active, cancellation marks) are the scheduler's
(:class:`genkit.Scheduler`); outputs wait in an :class:`~genkit.continuous.outputs.OutputRouter`,
which hands each one out exactly once.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from genkit.errors import ConfigError, InvalidStateError, NotSupportedError, QueueFullError
from genkit.models.paged import StepBatch, paged_store_for, require_paged
from genkit.strategy.finish import finish_codes, reason_names
from genkit.strategy.sampling import argmax_rows, choose
from genkit.threads import release_openmp_workers

from .block_allocator import BlockAllocator
from .config import ContinuousBatchingConfig, warn_no_effect
from .gate import argument_refusal, check_model, refusal, take_arguments
from .outputs import OutputRouter, call_in_loop
from .requests import GenerationOutput, RequestState, RequestStatus, own_objects
from .scheduler import scheduler_from
from .solo import SoloDecoder, take_greedy

logger = logging.getLogger("genkit.continuous")

__all__ = ["ContinuousBatchingManager"]

_UNSET: Any = object()


class ContinuousBatchingManager:
    """See the module docstring and docs/continuous_batching.md."""

    def __init__(self, model: Any, generation_config: Any = None, manual_eviction: bool = False,
                 max_queue_size: int = 0, continuous_batching_config: Any = None) -> None:
        from genkit.config import GenerationConfig
        from genkit.generation.api import merge_config

        check_model(model)
        require_paged(model)  # before the cache is sized from the config (a Llama family's fields)
        self.model = model
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise ConfigError(f"`generation_config` must be a genkit.GenerationConfig; got "
                              f"{type(generation_config).__name__}")
        self._given_config = generation_config
        self.generation_config, _ = merge_config(model, generation_config, {})
        cb = ContinuousBatchingConfig.coerce(continuous_batching_config) or \
            ContinuousBatchingConfig.from_generation_config(self.generation_config)
        cb = cb.resolved(model)
        self.cb_config = cb
        if isinstance(max_queue_size, bool) or not isinstance(max_queue_size, int) or max_queue_size < 0:
            raise ConfigError(f"`max_queue_size` must be an int >= 0 (0: unbounded); got {max_queue_size!r}")
        self.max_queue_size = max_queue_size or cb.max_queue_size
        self.manual_eviction = manual_eviction
        if getattr(self.generation_config, "compile_config", None) is not None:
            logger.warning("`compile_config` has no effect on continuous batching: genkit does not torch.compile "
                           "the paged forward")
        warn_no_effect(cb)
        self.store = paged_store_for(model, block_size=cb.block_size, num_blocks=cb.num_blocks)  # the K/V tensors
        # a model whose step can give plain greedy requests their tokens alone (protocols.PagedLM)
        self._paged_greedy = "greedy" in inspect.signature(model.forward_paged).parameters
        # which blocks of the store each request holds
        self.cache = BlockAllocator(block_size=cb.block_size, num_blocks=cb.num_blocks,
                                    allow_block_sharing=cb.allow_block_sharing)
        self.scheduler = scheduler_from(cb, self.cache, self.generation_config.prefill_chunk_size)
        self.initial_free_blocks = self.cache.free_blocks
        self.solo = SoloDecoder(model, self.store, self.scheduler)  # a lone greedy request, self-speculating
        self._input: queue.Queue[RequestState] = queue.Queue()
        self._held: list[RequestState] = []  # added once stop() was called: they run from the next start()
        self._evict: queue.Queue[str] = queue.Queue()
        self.output_router = OutputRouter(self.is_running)
        self._lock = threading.Lock()  # request ids, the live set, the seeder, the queue bound
        self._live: set[str] = set()  # requests added and not yet delivered as finished or failed
        self._next_id = 0  # of the next generated request id, req_N
        self._order = itertools.count()
        self._seeder = None if cb.seed is None else torch.Generator().manual_seed(cb.seed)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._hard_stop = True
        self._pause = threading.Condition()
        self._pausers = 0
        self._paused = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._kept: dict[str, RequestState] = {}  # finished requests whose blocks stay (manual eviction)
        self.steps = 0
        self.reused_prompt_tokens = 0  # prompt tokens the prompt cache held, not computed
        self.warmed_up = False

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop's thread; after ``stop(block=False)`` (or a stop whose ``timeout`` passed),
        first wait for that stop to end (it fails or finishes the requests it holds)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            if not self._stop.is_set():
                logger.warning("the continuous batching manager is already running")
                return
            thread.join()
        with self._lock:
            self._stop.clear()
            for state in self._held:  # added while it was stopping or stopped
                self._input.put(state)
            self._held.clear()
        self._hard_stop = True
        # the steps run in the manager's thread: the caller's idle OpenMP pool beside its pool would
        # make the runtime put workers to sleep between parallel regions (genkit.threads)
        release_openmp_workers()
        self._thread = threading.Thread(target=self._loop, name="genkit-continuous-batching", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool | None = None) -> None:
        """Stop the loop. By default (``hard_stop`` None or True) the requests not finished are
        failed with an error saying so; ``hard_stop=False`` (transformers' flush) lets the loop
        finish every request it holds first. ``block``: wait for the thread (at most ``timeout``
        seconds). ``keep_for_next_session``: the model keeps this manager, and its next
        ``init_continuous_batching`` returns it. A request added from now on waits for the next
        ``start()`` (a flush would otherwise never end while requests keep coming)."""
        trigger = time.perf_counter()
        self._hard_stop = hard_stop is not False
        with self._lock:
            self._stop.set()
        self._wake.set()
        if block:
            self.join(trigger, timeout)
        if keep_for_next_session:
            self.model._cached_continuous_batching_manager = self

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait for the loop's thread to end, at most ``timeout`` seconds (transformers' signature:
        ``stop_trigger_time`` is the ``time.perf_counter()`` of the stop request, for the log)."""
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the continuous batching thread did not end within %s s", timeout)
            return
        if stop_trigger_time is not None:
            logger.info("the continuous batching thread ended %.2f s after the stop", time.perf_counter() - stop_trigger_time)
        if self._thread is thread:
            self._thread = None

    def destroy(self) -> None:
        """Stop the manager (if running) and drop it from its model's cache."""
        if self.is_running():
            self.stop(block=True)
        if getattr(self.model, "_cached_continuous_batching_manager", None) is self:
            del self.model._cached_continuous_batching_manager

    def warmup(self) -> None:
        """transformers captures CUDA graphs here; a CPU has none to capture, so this only marks the
        manager as warmed up."""
        self.warmed_up = True

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Pause the loop between two steps while the block runs (e.g. to change the model in
        place); it resumes with its cache and requests when the last pausing thread leaves."""
        if not self.is_running():
            raise InvalidStateError("cannot pause: the continuous batching manager is not running")
        with self._pause:
            self._pausers += 1
            self._wake.set()
            while not self._paused and self.is_running():
                self._pause.wait(0.05)
        try:
            yield
        finally:
            with self._pause:
                self._pausers -= 1
                self._pause.notify_all()

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(block=True, timeout=30)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id: Any = _UNSET,
                    top_logprobs: int | None = None, raise_refusal: bool = False, prompt_logprobs: int | None = None,
                    **generation_kwargs: Any) -> str:
        """Queue a request; returns its id. ``generation_kwargs`` are this request's own
        generation fields (``do_sample``, ``temperature``, ``top_p``, ``repetition_penalty``,
        ``max_time``, ``stop_strings``, ``seed``…), over the manager's generation config, and what
        ``generate`` takes besides them: ``tokenizer`` (stop strings need it), ``stopping_criteria``
        and ``logits_processor`` (lists of this request's own objects). A request stops where
        ``generate`` would stop it (``genkit.strategy.finish_codes``); its output says why
        (``finish_reason``). ``top_logprobs``: report each token's log-probability and its
        ``top_logprobs`` most likely alternatives (0: the token's only). ``prompt_logprobs``: score
        the prompt's own tokens too (the output's ``prompt_logprobs``, ``prompt_logprobs``
        alternatives each: :mod:`genkit.generation.scoring`), computed in the steps that compute the
        prompt (every position's logits; a prompt-cache prefix is reused as far as its tokens' scores were
        published with as many alternatives: :mod:`genkit.continuous.block_allocator`). ``max_new_tokens`` past
        the model's context is ``generate``'s error; the default length is capped by it (the output's
        ``max_new_tokens`` is the limit applied); 0 with
        ``prompt_logprobs``: the prompt is only scored (the request finishes once it is computed,
        ``finish_reason`` ``"length"``, no token chosen: OpenAI's ``max_tokens: 0`` with ``echo``). A request
        that cannot run (an empty prompt, ``max_new_tokens`` <= 0 otherwise, a request that can never fit
        the cache) is returned at once as a failed output with an error saying why; the manager
        goes on. So is one whose settings continuous batching cannot run (beam search, contrastive
        search, ...: the gate, :func:`genkit.continuous.gate.refusal`), with an error naming the
        field; with ``raise_refusal=True`` that refusal is raised instead (a
        :class:`~genkit.errors.NotSupportedError`; nothing is queued), for a caller with another
        engine to run it on (``genkit serve``). With ``max_queue_size`` requests waiting, a new one
        is a :class:`QueueFullError`. The id of a request still running (or keeping its blocks under
        ``manual_eviction``) is a :class:`ConfigError`; generated ids skip the ids in use."""
        request_id = self._reserve_id(request_id)
        try:
            score_only = type(max_new_tokens) is int and max_new_tokens == 0 and prompt_logprobs is not None
            state = self._new_state(list(input_ids), request_id, max_new_tokens, streaming, record_timestamps,
                                    eos_token_id, generation_kwargs, score_only)
            state.top, state.return_logprobs = _top_logprobs(request_id, top_logprobs, state.return_logprobs)
            self._score_prompt(state, prompt_logprobs)
        except (ValueError, TypeError) as exc:
            self._unreserve_id(request_id)
            if raise_refusal and isinstance(exc, NotSupportedError):
                raise
            failed = RequestState(request_id, [int(t) for t in input_ids] if _ints(input_ids) else [], 0,
                                  None, None, None, status=RequestStatus.FAILED, error=str(exc))
            self.output_router.deliver(failed.output())
            return request_id
        except BaseException:
            self._unreserve_id(request_id)
            raise
        with self._lock:
            try:
                self._check_room(request_id)  # again: other threads may have queued requests meanwhile
            except QueueFullError:
                self._live.discard(request_id)
                self.scheduler.forget_cancellation(request_id)
                raise
            if self._stop.is_set():  # stopping or stopped: the next start() runs it
                self._held.append(state)
            else:
                self._input.put(state)
        self._wake.set()
        return request_id

    def _reserve_id(self, request_id: str | None) -> str:
        """Take ``request_id`` (None: the next free ``req_N``) for a new request: two requests with
        one id would share the scheduler's entry, and the first would never end nor free its blocks."""
        if request_id is not None and not isinstance(request_id, str):
            raise ConfigError(f"`request_id` must be a str or None; got {type(request_id).__name__}")
        with self._lock:
            if request_id is None:
                while self._id_taken(f"req_{self._next_id}"):
                    self._next_id += 1
                self._check_room(f"req_{self._next_id}")  # a full queue takes no id
                request_id = f"req_{self._next_id}"
                self._next_id += 1
            elif self._id_taken(request_id):
                why = (f"keeps its cache blocks (manual_eviction): evict_request_from_cache({request_id!r}) first, "
                       "or give another id" if request_id in self._kept else "is still running; give another id")
                raise ConfigError(f"`request_id` {request_id!r} is in use: a request with that id {why}")
            else:
                self._check_room(request_id)
            self._live.add(request_id)  # cancel_request finds it from now on
        return request_id

    def _check_room(self, request_id: str) -> None:
        """Raise :class:`QueueFullError` when ``max_queue_size`` requests wait already (under ``_lock``)."""
        waiting = self._input.qsize() + len(self._held) + len(self.scheduler.waiting_requests)
        if self.max_queue_size and waiting >= self.max_queue_size:
            raise QueueFullError(f"request {request_id!r}: {waiting} requests are waiting, the most "
                                 f"`max_queue_size` allows ({self.max_queue_size}); add it once some have started")

    def _id_taken(self, request_id: str) -> bool:
        return request_id in self._live or request_id in self._kept

    def _unreserve_id(self, request_id: str) -> None:
        """Give back the id of a request that failed on arrival (with any cancellation mark it got)."""
        with self._lock:
            self._live.discard(request_id)
            self.scheduler.forget_cancellation(request_id)

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **generation_kwargs: Any) -> list[str]:
        """:meth:`add_request` for each of ``inputs`` with the same settings; given to several, a
        ``logits_processor`` or ``stopping_criteria`` list is copied for each (:func:`own_objects`)."""
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps,
                                 **(own_objects(generation_kwargs) if len(inputs) > 1 else generation_kwargs))
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Stop a request whether it waits, computes its prompt or generates: it never yields a
        finished result (its last output has status FAILED and error "cancelled"), and its blocks
        are freed. A request already delivered is not affected (with ``manual_eviction`` its kept
        blocks are freed)."""
        with self._lock:
            live = request_id in self._live
            if live:
                self.scheduler.set_request_cancellation(request_id)
        if not live and self.manual_eviction:
            self._evict.put(request_id)
        self._wake.set()

    def evict_request_from_cache(self, request_id: str) -> None:
        """Free the blocks a finished request kept (``manual_eviction=True``)."""
        self._evict.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` when given), each output handed out once; None after
        ``timeout`` seconds (without a timeout: at once when nothing is queued and the manager is not
        running)."""
        return self.output_router.take(request_id, timeout)

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """The outputs of ``request_id`` as they come (every token for a streaming request), until
        it finishes or fails (or the manager stops; ``timeout``: or no output came for that long)."""
        while True:
            out = self.output_router.take(request_id, 0.1 if timeout is None else timeout)
            if out is None:
                if timeout is not None or not self.is_running():
                    return
                continue
            yield out
            if out.is_finished():
                return

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Every output as it comes, until the manager stops and nothing is left."""
        while True:
            out = self.output_router.take(None, 0.1)
            if out is not None:
                yield out
            elif not self.is_running() and self.output_router.empty():
                return

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Hand ``request_id``'s outputs to ``callback`` instead of the queue (outputs already queued
        first), until it finishes. Called inside a running asyncio loop, the callback runs on that
        loop (``call_soon_threadsafe``), as in transformers; otherwise on the manager's thread."""
        self.output_router.set_handler(request_id, call_in_loop(callback))

    # -- inside: requests ---------------------------------------------------------------------------
    def _new_state(self, prompt: list[int], request_id: str, max_new_tokens: int | None, streaming: bool,
                   record_timestamps: bool, eos_token_id: Any, kwargs: dict[str, Any],
                   score_only: bool = False) -> RequestState:
        from genkit.generation.api import prepare

        self._check_prompt(request_id, prompt)
        # before the settings are read: a recipe's own are no fields
        _refuse(request_id, argument_refusal(take_arguments(kwargs)))
        # a prompt only scored chooses no token: its settings are read as for one
        max_new = self._max_new_tokens(request_id, len(prompt), 1 if score_only else max_new_tokens, kwargs)
        seed = kwargs.pop("seed", None)
        if eos_token_id is not _UNSET:  # None: no end-of-sequence token for this request
            kwargs["eos_token_id"] = eos_token_id
        processors, criteria = kwargs.pop("logits_processor", None), kwargs.pop("stopping_criteria", None)
        _check_request_fields(request_id, kwargs)
        # the request's own length settings, read by prepare as generate reads them (a max_length made
        # max_new_tokens here would meet a min_new_tokens beyond it, which generate runs)
        asked = max_new_tokens is not None or score_only
        prepared = prepare(self.model, torch.tensor([prompt]), self._given_config, processors, criteria, None, None,
                           {**kwargs, "max_new_tokens": max_new} if asked else kwargs)
        max_new = 0 if score_only else max_new
        config = prepared.config
        _refuse(request_id, refusal(config))  # the one gate (gate.py): no setting is dropped on the way
        self._check_fits(request_id, len(prompt), max_new)
        generator = torch.Generator(device=self.model.device)  # where the logits are sampled
        generator.manual_seed(int(seed) if seed is not None else self._draw_seed())
        return RequestState(request_id, prompt, max_new, prepared.stopping_criteria, config,
                            prepared.logits_processor if len(prepared.logits_processor) else None,
                            do_sample=bool(config.do_sample), generator=generator, streaming=streaming,
                            record_timestamps=record_timestamps, return_logprobs=self.cb_config.return_logprobs,
                            order=next(self._order))

    def _score_prompt(self, state: RequestState, top: int | None) -> None:
        """Have ``state``'s prompt scored with ``top`` alternatives per token (None: not scored), its
        prompt chunks within the logits budget of :func:`genkit.generation.scoring.score_prompt`."""
        from genkit.generation.scoring import check_top_n, chunk_positions

        if top is None:
            return
        vocab = self.model.config.vocab_size
        try:
            check_top_n(top, "prompt_logprobs", vocab, f"the vocabulary's size ({vocab}) or None")
        except ConfigError as exc:
            raise ConfigError(f"request {state.request_id!r}: {exc}") from None
        state.prompt_top, state.score_chunk = top, chunk_positions(vocab)

    def _check_prompt(self, request_id: str, prompt: list[int]) -> None:
        if not prompt:
            raise ConfigError(f"request {request_id!r}: the prompt is empty")
        if not _ints(prompt):
            raise ConfigError(f"request {request_id!r}: `input_ids` must be a list of token ids (ints)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if t < 0 or t >= vocab]
        if bad:
            raise ConfigError(f"request {request_id!r}: token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
        capacity = self.cache.capacity
        if len(prompt) + 1 > capacity:
            raise ConfigError(f"request {request_id!r}: the prompt has {len(prompt)} tokens; the cache holds "
                              f"{capacity} (num_blocks * block_size)")

    def _max_new_tokens(self, request_id: str, prompt_len: int, max_new_tokens: int | None,
                        kwargs: dict[str, Any]) -> int:
        """The request's limit, read as ``generate`` reads it (:func:`genkit.config.resolve_lengths`
        with the model's context): as asked, else what ``generate`` runs for its settings
        (``kwargs``) over the manager's config (``max_new_tokens``, or ``max_length`` less the
        prompt). A length past the model's context is ``generate``'s error; the default length
        (no ``max_new_tokens`` nor ``max_length`` set) is capped by the context, as there."""
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens <= 0):
            raise ConfigError(f"request {request_id!r}: `max_new_tokens` must be an int >= 1; got {max_new_tokens!r}")
        context = getattr(self.model.config, "max_position_embeddings", None)
        context = context if isinstance(context, int) and context > 0 else None
        if context is not None and prompt_len >= context:
            raise ConfigError(f"request {request_id!r}: the prompt has {prompt_len} tokens; the model's context "
                              f"is {context} (max_position_embeddings)")
        settings = kwargs if max_new_tokens is None else {**kwargs, "max_new_tokens": max_new_tokens}
        max_new = self._configured_max_new(prompt_len, settings, context)  # generate's errors, as they are
        if max_new <= 0:
            raise ConfigError(f"request {request_id!r}: `max_new_tokens` must be an int >= 1; got {max_new!r}")
        return max_new

    def _configured_max_new(self, prompt_len: int, kwargs: dict[str, Any], context: int | None = None) -> int:
        """The new tokens ``generate`` allows a prompt of ``prompt_len`` tokens with these request
        settings: the one reading of ``max_new_tokens`` / ``max_length`` (a ``max_length`` from the
        call, the manager's config or the model's ``generation_config.json`` counts the prompt) and
        of the model's ``context``."""
        from genkit.config import field_table, resolve_lengths
        from genkit.generation.api import merge_config

        table = field_table()
        config, _ = merge_config(self.model, self._given_config, {k: v for k, v in kwargs.items() if k in table})
        return int(resolve_lengths(config, prompt_len, context).max_length) - prompt_len

    def _check_fits(self, request_id: str, prompt_len: int, max_new: int) -> None:
        """Refuse a request whose prompt and new tokens can never fit the cache (its prompt alone
        is checked with the prompt)."""
        capacity = self.cache.capacity
        if prompt_len + max_new > capacity:
            raise ConfigError(f"request {request_id!r}: the prompt ({prompt_len} tokens) and max_new_tokens "
                              f"({max_new}) can never fit the cache, which holds {capacity} tokens "
                              "(num_blocks * block_size); raise num_blocks or lower max_new_tokens")

    def _draw_seed(self) -> int:
        with self._lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._seeder).item())

    # -- inside: the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not (self._stop.is_set() and (self._hard_stop or not self._has_work())):
                self._maybe_pause()
                self._take_inputs()
                if not self.scheduler.has_pending_requests():
                    self.solo.prepare()  # (once: the draft a lone request's decode needs, made while idle)
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
        except BaseException as exc:  # noqa: BLE001 - a bug: fail every request rather than hang them
            self.error = exc
            logger.exception("continuous batching loop failed")
        finally:
            self._fail_all("the continuous batching manager stopped" if self.error is None
                           else f"the continuous batching manager failed: {self.error}")
            self.solo.release()  # (a copy of a request's cache, kept while the loop ran)
            self.output_router.wake()

    def _has_work(self) -> bool:
        return self.scheduler.has_pending_requests() or not self._input.empty()

    def _maybe_pause(self) -> None:
        with self._pause:
            while self._pausers > 0 and not self._stop.is_set():
                self._paused = True
                self._pause.notify_all()
                self._pause.wait(0.05)
            self._paused = False

    def _take_inputs(self) -> None:
        while True:
            try:
                self.scheduler.add_waiting_request(self._input.get_nowait())
            except queue.Empty:
                break
        for r in self.scheduler.clear_cancelled_requests():
            self._fail(r, "cancelled")
        while True:
            try:
                rid = self._evict.get_nowait()
            except queue.Empty:
                break
            kept = self._kept.pop(rid, None)
            if kept is not None:
                self.cache.release(kept.blocks)
                kept.blocks = []

    def _close(self, r: RequestState) -> bool:
        """``r`` is about to be delivered for the last time: whether it was cancelled meanwhile."""
        with self._lock:
            self._live.discard(r.request_id)
            return self.scheduler.forget_cancellation(r.request_id)

    def _fail(self, r: RequestState, reason: str) -> None:
        self.solo.forget(r.request_id)
        self.cache.release(r.blocks)
        r.blocks = []
        self._close(r)
        r.status, r.error = RequestStatus.FAILED, reason
        r.finish_reason = "cancelled" if reason == "cancelled" else None
        self.output_router.deliver(r.output())

    def _complete(self, r: RequestState) -> None:
        self.solo.forget(r.request_id)
        self.scheduler.active_requests.pop(r.request_id, None)
        if self.manual_eviction:  # before it leaves the live set: its id stays taken while it keeps blocks
            self._kept[r.request_id] = r
        if self._close(r):  # cancelled while its last token was computed: never a finished result
            self._kept.pop(r.request_id, None)
            self.cache.release(r.blocks)
            r.blocks = []
            r.status, r.error, r.finish_reason = RequestStatus.FAILED, "cancelled", "cancelled"
        else:
            r.status = RequestStatus.FINISHED
            self.cache.publish(r.tokens, r.blocks, r.cached)  # prompt and completion, for a next turn
            if not self.manual_eviction:
                self.cache.release(r.blocks)
                r.blocks = []
        self.output_router.deliver(r.output())

    def _fail_all(self, reason: str) -> None:
        for r in list(self.scheduler.waiting_requests.values()) + list(self.scheduler.active_requests.values()):
            self._fail(r, reason)
        self.scheduler.reset()
        while True:
            try:
                self._fail(self._input.get_nowait(), reason)
            except queue.Empty:
                break
        for kept in self._kept.values():
            self.cache.release(kept.blocks)
        self._kept.clear()

    def _evict_oldest_kept(self) -> bool:
        """Nothing can run: free the blocks of the request kept longest for ``evict_request_from_cache``
        (``manual_eviction``), if any, so that kept blocks never stall the requests that run. Its
        prompt and completion stay in the prompt cache while no allocation needs their blocks."""
        if not self._kept:
            return False
        request_id, kept = next(iter(self._kept.items()))
        del self._kept[request_id]
        logger.warning("request %r: its kept blocks are freed before evict_request_from_cache (manual_eviction): the "
                       "requests that run need them", request_id)
        self.cache.release(kept.blocks)
        kept.blocks = []
        return True

    def _interrupted(self, r: RequestState) -> bool:
        """Whether the loop has something to do besides running request ``r``'s steps: a request
        arrived, ``r`` was cancelled, or the manager stops or pauses."""
        return (not self._input.empty() or self._stop.is_set() or self._pausers > 0
                or self.scheduler.request_is_cancelled(r.request_id))

    def _run_alone(self) -> bool:
        """The one running request decoded alone by :class:`~genkit.continuous.solo.SoloDecoder` (a
        plain greedy request, nothing waiting); whether it made progress."""
        s = self.scheduler
        if not self.solo.available or s.waiting_requests or len(s.active_requests) != 1:
            return False
        r = next(iter(s.active_requests.values()))
        if (r.status != RequestStatus.DECODING or r.pending != 1 or not _is_plain_greedy(r) or not self.solo.wants(r)
                or self._interrupted(r)):
            return False
        before = r.cached
        if self.solo.run(r, lambda: self._interrupted(r), lambda r: self.output_router.deliver_all([r.output()])):
            self._complete(r)
        return r.cached > before

    def _step(self) -> None:
        if self._run_alone():
            return
        plan = self.scheduler.schedule_batch(self.cb_config.max_batch_tokens, None)
        if not plan:
            if not self._evict_oldest_kept():
                time.sleep(0.001)
            return
        ids: list[int] = []
        positions: list[int] = []
        spans, cached, blocks, want = [], [], [], []
        for src, dst, n in self.cache.take_copies():  # the prompt cache's partial blocks
            self.store.copy(src, dst, n)
            self.cache.release([src])
        for r, n in plan:
            if r.started < 0:
                r.started = time.perf_counter()
                self.reused_prompt_tokens += r.cached  # taken from the prompt cache
            spans.append((len(ids), n))
            ids += r.tokens[r.cached:r.cached + n]
            positions += range(r.cached, r.cached + n)
            cached.append(r.cached)
            blocks.append(r.blocks)
            want.append(n if r.scoring else int(r.cached + n == r.length))
        batch = StepBatch(torch.tensor(ids), torch.tensor(positions), spans, cached, blocks, want)
        if self._paged_greedy and any(want) and all(_is_plain_greedy(r) for (r, _), w in zip(plan, want) if w):
            logits = self.model.forward_paged(batch, self.store, greedy=True)  # the tokens, or the logits
        else:
            logits = self.model.forward_paged(batch, self.store)
        self.steps += 1
        self._after_step(plan, want, logits)

    def _after_step(self, plan: list[tuple[RequestState, int]], want: list[int], logits: torch.Tensor) -> None:
        """The step's logits (rows: each request's last ``want`` tokens', :func:`~genkit.models.paged.logit_rows`)
        turned into its requests' prompt scores and next tokens."""
        ends = list(itertools.accumulate(int(w) for w in want))  # each request's rows end here
        plain = _plain_greedy([(r, end - 1) for (r, _), w, end in zip(plan, want, ends) if w], logits)
        done, streamed = [], []
        for (r, n), w, end in zip(plan, want, ends):
            scored = r.scoring  # (as the step was planned: `want` kept all its positions' logits)
            start, r.cached = r.cached, r.cached + n
            try:
                if scored:
                    _score_chunk(r, start, logits[end - int(w):end])
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                done.append((r, f"scoring the prompt failed: {exc}"))
                continue
            if r.status == RequestStatus.PREFILLING and r.cached >= len(r.prompt_ids):
                self._publish_prompt(r)
            if not w:
                continue
            try:
                if r.cached < r.length:  # a scored prompt chunk before the last: no token to choose
                    continue
                if not r.max_new_tokens:  # a prompt only scored: done once computed
                    r.finish_reason = "length"
                    done.append((r, None))
                    continue
                token = plain.get(end - 1)
                finished = self._choose(r, logits[end - 1]) if token is None else take_greedy(r, token)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                done.append((r, f"choosing the next token failed: {exc}"))
                continue
            r.status = RequestStatus.DECODING
            if r.record_timestamps:
                r.timestamps.append(time.perf_counter())
            if finished:
                done.append((r, None))
            elif r.streaming:
                streamed.append(r.output())
        self.output_router.deliver_all(streamed)  # the step's tokens, the readers woken once
        if any(len(out.generated_tokens) == 1 for out in streamed):  # a request's first token: its reader
            self.output_router.yield_to_readers()  # has it on its way before the next step takes the cores
        for r, error in done:
            if error is not None:
                self.scheduler.active_requests.pop(r.request_id, None)
                self._fail(r, error)
            else:
                self._complete(r)

    def _publish_prompt(self, r: RequestState) -> None:
        """Offer ``r``'s computed prompt to the prompt cache, with its tokens' scores if it was scored."""
        if r.prompt_top is None:
            self.cache.publish(r.prompt_ids, r.blocks, r.cached)
        else:
            self.cache.publish(r.prompt_ids, r.blocks, r.cached, scores=[None, *r.prompt_scores], top=r.prompt_top)

    def _choose(self, r: RequestState, logits: torch.Tensor) -> bool:
        """Choose ``r``'s next token (the sampler of ``generate``) and record it; whether it
        finishes the request (the finish decision of ``generate``, whose reason is recorded)."""
        scores = logits[None]
        history = torch.tensor([r.tokens], device=logits.device)  # built once a step: the processors' input, then the finish decision's
        if r.processors is not None:
            scores = r.processors(history, scores)
        choice = choose(scores, r.do_sample, r.generator, logprobs=r.return_logprobs, top=r.top)
        token, logprob, top = choice.row(0)
        r.generated.append(token)
        if r.return_logprobs:
            r.logprobs.append(float(logprob or 0.0))
        if r.top:
            r.top_logprobs.append(top)
        codes = finish_codes(r.stop, torch.cat([history, choice.tokens.view(1, 1).to(history.dtype)], dim=1), scores,
                             choice.tokens)
        r.finish_reason = reason_names(codes)[0]
        return r.finish_reason is not None


def _is_plain_greedy(r: RequestState) -> bool:
    """Whether ``r`` decodes greedily with nothing else to apply (no logits processor, no stopping
    criterion but EOS and length, no log-probabilities, no prompt left to score): its next token is
    its logits' first maximum."""
    return (r.processors is None and not r.do_sample and not r.return_logprobs and not r.top and r.stop is not None
            and not r.stop.criteria and not r.scoring)


def _score_chunk(r: RequestState, start: int, logits: torch.Tensor) -> None:
    """Score the prompt tokens that follow positions ``start`` .. of ``r``'s chunk (``logits``: one
    row per position) into ``r.prompt_scores`` (a prompt computed again after a preemption
    overwrites its scores)."""
    from genkit.generation.scoring import score_rows

    m = min(start + logits.shape[0], len(r.prompt_ids) - 1) - start  # positions whose next token is the prompt's
    del r.prompt_scores[start:]
    if m > 0:
        tokens = torch.tensor(r.prompt_ids[start + 1:start + 1 + m], device=logits.device)
        r.prompt_scores += score_rows(logits[:m], tokens, r.prompt_top or 0)


def _plain_greedy(rows: list[tuple[RequestState, int]], logits: torch.Tensor) -> dict[int, int]:
    """The next token, by row of ``logits``, of each plain greedy request (:func:`_is_plain_greedy`)
    of ``rows`` (each request wanting logits, with its last row): one argmax over all their rows
    (the sampler's greedy choice, :func:`~genkit.strategy.sampling.argmax_rows`) instead of one per
    request. ``logits`` may be those tokens already (a step asked for them: every row's request is
    plain greedy, one row each)."""
    if logits.dtype == torch.long:
        return dict(enumerate(logits.tolist()))
    picked = [i for r, i in rows if _is_plain_greedy(r)]
    if not picked:
        return {}
    scores = logits if len(picked) == logits.shape[0] else logits.index_select(0, torch.tensor(picked,
                                                                                              device=logits.device))
    return dict(zip(picked, argmax_rows(scores).tolist()))


def _top_logprobs(request_id: str, top: int | None, default: bool) -> tuple[int, bool]:
    """(alternatives per token, whether to record log-probabilities) for ``top_logprobs=top``."""
    if top is None:
        return 0, default
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"request {request_id!r}: `top_logprobs` must be an int >= 0 or None; got {top!r}")
    return top, True


def _check_request_fields(request_id: str, kwargs: dict[str, Any]) -> None:
    """Refuse a request's own ``continuous_batching_config`` (the manager's, fixed when it was made:
    it would be dropped); say that its own ``compile_config`` has no effect, as for the manager's."""
    if kwargs.get("continuous_batching_config") is not None:
        raise ConfigError(f"request {request_id!r}: `continuous_batching_config` configures the manager "
                          "(init_continuous_batching / generate_batch's continuous_batching_config=), not one request")
    if kwargs.get("compile_config") is not None:
        logger.warning("request %r: `compile_config` has no effect on continuous batching: genkit does not "
                       "torch.compile the paged forward", request_id)


def _refuse(request_id: str, why: str | None) -> None:
    """Raise the gate's refusal ``why`` of a request, if any."""
    if why is not None:
        raise NotSupportedError(f"request {request_id!r}: continuous batching cannot run it: {why}")


def _ints(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in values)
