"""``ContinuousBatchingManager``: a background thread that batches requests step by step.

Requests arrive through :meth:`add_request` from any thread; the loop schedules a step
(:mod:`~genkit.continuous.scheduler`), runs it (the model's paged forward, :mod:`genkit.models.paged`),
chooses each request's next token with its own logits processors and random generator, and
publishes outputs: every token for a streaming request, the final output otherwise. A request that
fails (a bad token id, a processor that raises) fails alone; the loop goes on with the others.
Names and semantics follow transformers 5's ``ContinuousBatchingManager``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from genkit.errors import ConfigError, NotSupportedError
from genkit.models.paged import StepBatch, paged_store_for
from genkit.strategy.finish import finish_codes, reason_names
from genkit.strategy.sampling import choose

from .block_allocator import BlockAllocator
from .config import ContinuousBatchingConfig
from .gate import UNSUPPORTED_ARGUMENTS, check_model, refusal
from .requests import GenerationOutput, RequestState, RequestStatus
from .scheduler import scheduler_from

logger = logging.getLogger("genkit.continuous")

__all__ = ["ContinuousBatchingManager"]

_UNSET: Any = object()


class ContinuousBatchingManager:
    """See the module docstring and docs/continuous_batching.md."""

    def __init__(self, model: Any, generation_config: Any = None, manual_eviction: bool = False,
                 max_queue_size: int = 0, continuous_batching_config: ContinuousBatchingConfig | None = None) -> None:
        from genkit.config import GenerationConfig
        from genkit.generation.api import merge_config

        check_model(model)
        self.model = model
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise ConfigError(f"`generation_config` must be a genkit.GenerationConfig; got "
                              f"{type(generation_config).__name__}")
        self._given_config = generation_config
        self.generation_config, _ = merge_config(model, generation_config, {})
        cb = continuous_batching_config or ContinuousBatchingConfig.from_generation_config(self.generation_config)
        cb = cb.resolved(model)
        self.cb_config = cb
        if not isinstance(max_queue_size, int) or max_queue_size < 0:
            raise ConfigError(f"`max_queue_size` must be an int >= 0 (0: unbounded); got {max_queue_size!r}")
        self.max_queue_size = max_queue_size or cb.max_queue_size
        self.manual_eviction = manual_eviction
        self.store = paged_store_for(model, block_size=cb.block_size, num_blocks=cb.num_blocks)  # the K/V tensors
        # which blocks of the store each request holds
        self.cache = BlockAllocator(block_size=cb.block_size, num_blocks=cb.num_blocks,
                                    allow_block_sharing=cb.allow_block_sharing)
        self.scheduler = scheduler_from(cb, self.cache, self.generation_config.prefill_chunk_size)
        self.initial_free_blocks = self.cache.free_blocks
        self._input: queue.Queue[RequestState] = queue.Queue(maxsize=self.max_queue_size)
        self._cancel: queue.Queue[str] = queue.Queue()
        self._evict: queue.Queue[str] = queue.Queue()
        self._outputs: queue.Queue[GenerationOutput] = queue.Queue()
        self._by_id: dict[str, queue.Queue[GenerationOutput]] = {}
        self._routes_lock = threading.Lock()
        self._counter = itertools.count()
        self._order = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._waiting: deque[RequestState] = deque()
        self._active: list[RequestState] = []
        self._kept: dict[str, RequestState] = {}  # finished requests whose blocks stay (manual eviction)
        self.steps = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self.is_running():
            logger.warning("the continuous batching manager is already running")
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="genkit-continuous-batching", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop (requests not finished are failed with an error saying so)."""
        self._stop.set()
        self._wake.set()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None

    def __enter__(self) -> ContinuousBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(block=True, timeout=30)

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id: Any = _UNSET,
                    top_logprobs: int | None = None, **generation_kwargs: Any) -> str:
        """Queue a request; returns its id. ``generation_kwargs`` are this request's own
        generation fields (``do_sample``, ``temperature``, ``top_p``, ``repetition_penalty``,
        ``max_time``, ``stop_strings``, ``seed``…), over the manager's generation config, and what
        ``generate`` takes besides them: ``tokenizer`` (stop strings need it), ``stopping_criteria``
        and ``logits_processor`` (lists of this request's own objects). A request stops where
        ``generate`` would stop it (``genkit.strategy.finish_codes``); its output says why
        (``finish_reason``). ``top_logprobs``: report each token's log-probability and its
        ``top_logprobs`` most likely alternatives (0: the token's only). A request that cannot run (an empty
        prompt, ``max_new_tokens`` <= 0, a prompt longer than the cache) is returned at once as a
        failed output with an error saying why; the manager goes on. So is one whose settings
        continuous batching cannot run (beam search, contrastive search, ...: the gate,
        :func:`genkit.continuous.gate.refusal`), with an error naming the field."""
        if request_id is None:
            request_id = f"req_{next(self._counter)}"
        if not isinstance(request_id, str):
            raise ConfigError(f"`request_id` must be a str or None; got {type(request_id).__name__}")
        with self._routes_lock:
            self._by_id.setdefault(request_id, queue.Queue())
        try:
            state = self._new_state(list(input_ids), request_id, max_new_tokens, streaming, record_timestamps,
                                    eos_token_id, generation_kwargs)
            state.top, state.return_logprobs = _top_logprobs(request_id, top_logprobs, state.return_logprobs)
        except (ValueError, TypeError) as exc:
            failed = RequestState(request_id, [int(t) for t in input_ids] if _ints(input_ids) else [], 0,
                                  None, None, None, status=RequestStatus.FAILED, error=str(exc))
            self._publish(failed.output())
            return request_id
        self._input.put(state, block=True, timeout=None if self.max_queue_size == 0 else 30)
        self._wake.set()
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **generation_kwargs: Any) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **generation_kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Stop a request: it never yields a finished result (a cancelled request's last output,
        if any is published, has status FAILED and error "cancelled"), and its blocks are freed."""
        self._cancel.put(request_id)
        self._wake.set()

    def evict_request_from_cache(self, request_id: str) -> None:
        """Free the blocks a finished request kept (``manual_eviction=True``)."""
        self._evict.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` when given); None after ``timeout`` seconds."""
        q = self._outputs if request_id is None else self._route(request_id)
        try:
            out = q.get(timeout=timeout)
        except queue.Empty:
            return None
        if request_id is None:
            self._drop_routed(out)
        else:
            self._drop_shared(out)
        return out

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """The outputs of ``request_id`` as they come (every token for a streaming request), until
        it finishes or fails."""
        while True:
            out = self.get_result(request_id, timeout=0.1 if timeout is None else timeout)
            if out is None:
                if not self.is_running() or timeout is not None:
                    return
                continue
            yield out
            if out.is_finished():
                return

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running() or not self._outputs.empty():
            out = self.get_result(timeout=0.1)
            if out is not None:
                yield out

    # -- inside: requests ---------------------------------------------------------------------------
    def _new_state(self, prompt: list[int], request_id: str, max_new_tokens: int | None, streaming: bool,
                   record_timestamps: bool, eos_token_id: Any, kwargs: dict[str, Any]) -> RequestState:
        from genkit.generation.api import prepare

        if not prompt:
            raise ConfigError(f"request {request_id!r}: the prompt is empty")
        if not _ints(prompt):
            raise ConfigError(f"request {request_id!r}: `input_ids` must be a list of token ids (ints)")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if t < 0 or t >= vocab]
        if bad:
            raise ConfigError(f"request {request_id!r}: token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
        max_new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if max_new is None:
            max_new = 20
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
            raise ConfigError(f"request {request_id!r}: `max_new_tokens` must be an int >= 1; got {max_new!r}")
        capacity = self.cache.num_blocks * self.cache.block_size
        if len(prompt) + 1 > capacity:
            raise ConfigError(f"request {request_id!r}: the prompt has {len(prompt)} tokens; the cache holds "
                              f"{capacity} (num_blocks * block_size)")
        max_new = min(max_new, capacity - len(prompt))
        seed = kwargs.pop("seed", None)
        if eos_token_id is not _UNSET:  # None: no end-of-sequence token for this request
            kwargs["eos_token_id"] = eos_token_id
        processors, criteria = kwargs.pop("logits_processor", None), kwargs.pop("stopping_criteria", None)
        arguments = {k: kwargs.pop(k) for k in list(kwargs) if k in UNSUPPORTED_ARGUMENTS}
        prepared = prepare(self.model, torch.tensor([prompt]), self._given_config, processors, criteria, None, None,
                           {**kwargs, "max_new_tokens": max_new})
        config = prepared.config
        why = refusal(config, **arguments)  # the one gate (gate.py): no setting is dropped on the way
        if why is not None:
            raise NotSupportedError(f"request {request_id!r}: continuous batching cannot run it: {why}")
        generator = torch.Generator()
        generator.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return RequestState(request_id, prompt, max_new, prepared.stopping_criteria, config,
                            prepared.logits_processor if len(prepared.logits_processor) else None,
                            do_sample=bool(config.do_sample), generator=generator, streaming=streaming,
                            record_timestamps=record_timestamps, return_logprobs=self.cb_config.return_logprobs,
                            order=next(self._order))

    def _route(self, request_id: str) -> queue.Queue[GenerationOutput]:
        with self._routes_lock:
            return self._by_id.setdefault(request_id, queue.Queue())

    def _publish(self, out: GenerationOutput) -> None:
        self._route(out.request_id).put(out)
        self._outputs.put(out)

    def _drop_routed(self, out: GenerationOutput) -> None:
        """An output taken from the shared queue is taken from its request's queue too."""
        q = self._route(out.request_id)
        try:
            q.get_nowait()
        except queue.Empty:
            pass
        if out.is_finished():
            with self._routes_lock:
                self._by_id.pop(out.request_id, None)

    def _drop_shared(self, out: GenerationOutput) -> None:
        with self._outputs.mutex:
            try:
                self._outputs.queue.remove(out)
            except ValueError:
                pass
        if out.is_finished():
            with self._routes_lock:
                self._by_id.pop(out.request_id, None)

    # -- inside: the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_inputs()
                if not self._active and not self._waiting:
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

    def _take_inputs(self) -> None:
        while True:
            try:
                self._waiting.append(self._input.get_nowait())
            except queue.Empty:
                break
        while True:
            try:
                self._drop(self._cancel.get_nowait(), "cancelled")
            except queue.Empty:
                break
        while True:
            try:
                rid = self._evict.get_nowait()
            except queue.Empty:
                break
            kept = self._kept.pop(rid, None)
            if kept is not None:
                self.cache.release(kept.blocks)
                kept.blocks = []

    def _drop(self, request_id: str, reason: str) -> None:
        for r in list(self._waiting):
            if r.request_id == request_id:
                self._waiting.remove(r)
                self._fail(r, reason)
                return
        for r in list(self._active):
            if r.request_id == request_id:
                self._active.remove(r)
                self._fail(r, reason)
                return
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            self.cache.release(kept.blocks)
            kept.blocks = []

    def _fail(self, r: RequestState, reason: str) -> None:
        self.cache.release(r.blocks)
        r.blocks = []
        r.status, r.error = RequestStatus.FAILED, reason
        r.finish_reason = "cancelled" if reason == "cancelled" else None
        self._publish(r.output())

    def _fail_all(self, reason: str) -> None:
        for r in list(self._waiting) + list(self._active):
            self._fail(r, reason)
        self._waiting.clear()
        self._active.clear()
        while True:
            try:
                self._fail(self._input.get_nowait(), reason)
            except queue.Empty:
                break
        for kept in self._kept.values():
            self.cache.release(kept.blocks)
        self._kept.clear()

    def _step(self) -> None:
        plan = self.scheduler.schedule(self._waiting, self._active)
        if not plan:
            if self._active or self._waiting:
                time.sleep(0.001)
            return
        ids: list[int] = []
        positions: list[int] = []
        spans, cached, blocks, want = [], [], [], []
        for r, n in plan:
            if r.started < 0:
                r.started = time.perf_counter()
            spans.append((len(ids), n))
            ids += r.tokens[r.cached:r.cached + n]
            positions += range(r.cached, r.cached + n)
            cached.append(r.cached)
            blocks.append(r.blocks)
            want.append(r.cached + n == r.length)
        batch = StepBatch(torch.tensor(ids), torch.tensor(positions), spans, cached, blocks, want)
        logits = self.model.forward_paged(batch, self.store)
        self.steps += 1
        row = 0
        done = []
        for (r, n), w in zip(plan, want):
            r.cached += n
            if r.status == RequestStatus.PREFILLING and r.cached >= len(r.prompt_ids):
                self.cache.publish(r.prompt_ids, r.blocks, r.cached)
            if not w:
                continue
            try:
                finished = self._choose(r, logits[row])
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                done.append((r, f"choosing the next token failed: {exc}"))
                row += 1
                continue
            row += 1
            r.status = RequestStatus.DECODING
            if r.record_timestamps:
                r.timestamps.append(time.perf_counter())
            if finished:
                done.append((r, None))
            elif r.streaming:
                self._publish(r.output())
        for r, error in done:
            self._active.remove(r)
            if error is not None:
                self._fail(r, error)
                continue
            r.status = RequestStatus.FINISHED
            if self.manual_eviction:
                self._kept[r.request_id] = r
            else:
                self.cache.release(r.blocks)
                r.blocks = []
            self._publish(r.output())

    def _choose(self, r: RequestState, logits: torch.Tensor) -> bool:
        """Choose ``r``'s next token (the sampler of ``generate``) and record it; whether it
        finishes the request (the finish decision of ``generate``, whose reason is recorded)."""
        scores = logits[None]
        history = torch.tensor([r.tokens])  # built once a step: the processors' input, then the finish decision's
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


def _top_logprobs(request_id: str, top: int | None, default: bool) -> tuple[int, bool]:
    """(alternatives per token, whether to record log-probabilities) for ``top_logprobs=top``."""
    if top is None:
        return 0, default
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"request {request_id!r}: `top_logprobs` must be an int >= 0 or None; got {top!r}")
    return top, True


def _ints(values: Any) -> bool:
    return isinstance(values, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in values)
