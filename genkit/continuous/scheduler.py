"""Schedulers: which requests run in the next batching step, and how many of their tokens.

transformers' public scheduler API (``transformers.generation.continuous_batching.Scheduler``,
followed as installed, 5.24): an abstract :class:`Scheduler` owns the waiting and active requests
of one manager and answers :meth:`Scheduler.schedule_batch` once a step; :class:`FIFOScheduler`
and :class:`PrefillFirstScheduler` are the two built-in policies, registered as ``"fifo"`` and
``"prefill_first"`` through the ``register_schedulers`` hook, like a pack's scheduler.

Each step has a token budget (``max_batch_tokens``) and a request budget
(``max_requests_per_batch``); a request's tokens need cache blocks. A prompt may be split over
several steps (chunked prefill, at most ``prefill_chunk_size`` tokens a step when set).

- ``fifo`` (transformers' default): decoding requests first (one token each), then prompts in
  arrival order; a new request is admitted only while the free blocks stay above a safety margin
  (``safety_margin`` of the cache, 0.2 by default), so that running requests can grow.
- ``prefill_first``: prompts first (continuing split prefills, then new requests in arrival order),
  then decoding requests with what is left of the budget.

When a decoding request needs a block and none is free, the most recently admitted other request
is preempted: its blocks are freed and it goes back to the front of the queue, to recompute its
prompt and what it generated so far (its tokens are kept). A request computing its prompt in chunks
that finds no free block preempts the most recently admitted request newer than itself: requests
that each hold part of their prompt never fill the cache and wait on each other.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .block_allocator import BlockAllocator
from .requests import RequestState, RequestStatus

__all__ = ["Budget", "FIFOScheduler", "Plan", "PrefillFirstScheduler", "Scheduler", "scheduler_class"]

Plan = list[tuple[RequestState, int]]  # the requests of a step with the number of tokens each computes


@dataclass
class Budget:
    """What is left of a step: tokens, cache positions read (None: no limit), requests, and the
    positions of scored prompts whose logits it keeps (None: none spent yet; their requests'
    ``score_chunk`` bounds them all together, so a step's logits stay within one logits budget)."""

    tokens: int
    cache: int | None
    requests: int
    logit_rows: int | None = None

    def spend(self, state: RequestState, n: int) -> None:
        self.tokens -= n
        self.requests -= 1
        if self.cache is not None:
            self.cache -= state.cached + n
        if state.scoring and state.score_chunk:
            self.logit_rows = self.scored_rows(state) - n

    def scored_rows(self, state: RequestState) -> int:
        """How many of a scored prompt's positions the step may still compute."""
        return state.score_chunk if self.logit_rows is None else self.logit_rows

    def allows(self, state: RequestState, n: int) -> bool:
        return n >= 1 and self.requests >= 1 and (self.cache is None or state.cached + n <= self.cache)


class Scheduler(ABC):
    """Decides which requests run in each step (transformers' ``Scheduler``).

    A manager creates one scheduler, hands it every new request (:meth:`add_waiting_request`), asks
    :meth:`schedule_batch` once a step, and calls :meth:`finish_request` when a request ends. The
    scheduler owns ``waiting_requests`` / ``waiting_requests_order`` (arrival order) and
    ``active_requests`` (admitted: their blocks are allocated), by request id. Subclasses implement
    :meth:`schedule_batch`, usually with :meth:`schedule_decode` and :meth:`schedule_prefill`.

    ``safety_margin``: the share of the cache that admissions leave free (None: the class's
    ``default_safety_margin``). ``max_requests_per_batch``: requests in one step.
    ``prefill_chunk_size``: at most this many prompt tokens of a request in one step (None: no cap);
    a request whose config sets its own (``add_request(prefill_chunk_size=...)``) uses that.
    """

    default_safety_margin: float = 0.0

    def __init__(self, cache: BlockAllocator, safety_margin: float | None = None, max_requests_per_batch: int = 64,
                 *, prefill_chunk_size: int | None = None) -> None:
        margin = self.default_safety_margin if safety_margin is None else safety_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            # (1 would keep the whole cache free: nothing would ever be admitted)
            raise ConfigError(f"`safety_margin` must be a number in [0, 1) or None; got {safety_margin!r}")
        if isinstance(max_requests_per_batch, bool) or not isinstance(max_requests_per_batch, int) or \
                max_requests_per_batch < 1:
            raise ConfigError(f"`max_requests_per_batch` must be an int >= 1; got {max_requests_per_batch!r}")
        self.cache = cache
        self.safety_margin = float(margin)
        self.max_requests_per_batch = max_requests_per_batch
        self.prefill_chunk_size = prefill_chunk_size
        self.preempted = 0
        self._cancellation_lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every request (a new generation loop)."""
        self.active_requests: dict[str, RequestState] = {}
        self.waiting_requests: dict[str, RequestState] = {}
        self.waiting_requests_order: deque[str] = deque()
        self._requests_to_cancel: set[str] = set()

    # -- transformers' API ------------------------------------------------------------------------
    def add_waiting_request(self, state: RequestState) -> None:
        """Queue a new request (at the end of the waiting list)."""
        self.waiting_requests[state.request_id] = state
        self.waiting_requests_order.append(state.request_id)

    @abstractmethod
    def schedule_batch(self, token_budget: int, cache_budget: int | None = None) -> Plan | None:
        """The next step: ``[(request, tokens), ...]``, each request with the number of its tokens
        to compute (a prompt chunk, or 1 for a decoding request). At most ``token_budget`` tokens,
        at most ``cache_budget`` cache positions read (None: no limit), at most
        ``max_requests_per_batch`` requests. Admitting a waiting request moves it to
        ``active_requests`` and allocates its blocks (:meth:`schedule_prefill` does both). An empty
        list or None: nothing can run now."""

    def has_pending_requests(self) -> bool:
        """Whether any request is waiting or active."""
        return bool(self.active_requests or self.waiting_requests)

    def finish_request(self, request_id: str) -> None:
        """A request ended (finished, failed or evicted): free its blocks, forget it."""
        state = self.active_requests.pop(request_id, None)
        if state is None and request_id in self.waiting_requests:
            state = self.waiting_requests.pop(request_id)
            self.waiting_requests_order.remove(request_id)
        if state is not None:
            self.cache.release(state.blocks)
            state.blocks = []

    def get_active_request_static_outputs(self, request_id: str) -> list[int]:
        """The tokens an active request generated so far ([] for another id)."""
        state = self.active_requests.get(request_id)
        return list(state.generated) if state is not None else []

    def set_request_cancellation(self, request_id: str) -> None:
        """Mark a request for cancellation (any thread); :meth:`clear_cancelled_requests` removes it."""
        with self._cancellation_lock:
            self._requests_to_cancel.add(request_id)

    def clear_cancelled_requests(self) -> list[RequestState]:
        """Remove the requests marked for cancellation from the waiting and active ones, free their
        blocks, and return them. A marked id that is neither waiting nor active yet (its request is
        still on its way to the scheduler) stays marked until it arrives."""
        cancelled = []
        with self._cancellation_lock:
            for request_id in list(self._requests_to_cancel):
                state = self.active_requests.pop(request_id, None)
                if state is None and request_id in self.waiting_requests:
                    state = self.waiting_requests.pop(request_id)
                    self.waiting_requests_order.remove(request_id)
                if state is None:
                    continue
                self.cache.release(state.blocks)
                state.blocks = []
                self._requests_to_cancel.discard(request_id)
                cancelled.append(state)
        return cancelled

    def request_is_cancelled(self, request_id: str) -> bool:
        """Whether a request is marked for cancellation or is neither waiting nor active."""
        with self._cancellation_lock:
            marked = request_id in self._requests_to_cancel
        return marked or (request_id not in self.active_requests and request_id not in self.waiting_requests)

    def forget_cancellation(self, request_id: str) -> bool:
        """Drop a request's cancellation mark; whether it had one (the manager, when it ends)."""
        with self._cancellation_lock:
            marked = request_id in self._requests_to_cancel
            self._requests_to_cancel.discard(request_id)
        return marked

    # -- building blocks for schedule_batch ------------------------------------------------------
    def budget(self, token_budget: int, cache_budget: int | None = None) -> Budget:
        return Budget(token_budget, cache_budget, self.max_requests_per_batch)

    def decoding_requests(self) -> list[RequestState]:
        """Active requests generating tokens, in arrival order."""
        return sorted((r for r in self.active_requests.values() if r.status == RequestStatus.DECODING),
                      key=lambda r: r.order)

    def prefilling_requests(self) -> list[RequestState]:
        """Admitted requests whose prompt is computed over several steps, in arrival order."""
        return sorted((r for r in self.active_requests.values() if r.status == RequestStatus.PREFILLING),
                      key=lambda r: r.order)

    def waiting_candidates(self) -> list[RequestState]:
        """Waiting requests in queue order (preempted ones at the front)."""
        return [self.waiting_requests[i] for i in self.waiting_requests_order]

    def schedule_decode(self, state: RequestState, plan: Plan, budget: Budget) -> bool:
        """Add an active request's next token(s) to ``plan``, growing its blocks (preempting the
        most recently admitted request not in ``plan`` when the cache is full). False when it
        cannot run this step."""
        n = state.pending
        if state.request_id not in self.active_requests or budget.tokens < n or not budget.allows(state, n):
            return False
        if not self._grow(state, n, plan):
            return False
        plan.append((state, n))
        budget.spend(state, n)
        return True

    def schedule_prefill(self, state: RequestState, plan: Plan, budget: Budget, *, margin: bool = False) -> bool:
        """Add a chunk of a request's prompt to ``plan``: an admitted (prefilling) request goes on, a
        waiting one is admitted (moved to ``active_requests``, with the cached blocks of a prompt
        prefix it shares). ``margin``: admit only while the free blocks stay above the safety
        margin. An admitted request that finds no free block for its next token preempts the most
        recently admitted requests newer than itself and not in ``plan`` (else requests that all hold
        part of their prompt could fill the cache and wait on each other for ever). False when it
        cannot run this step (the caller usually stops there)."""
        waiting = state.request_id in self.waiting_requests
        if waiting and margin and self.active_requests and self.cache.free_blocks - self.cache.blocks_for(
                min(state.pending, budget.tokens)) < self.safety_margin * self.cache.num_blocks:
            return False
        shared = waiting and not state.blocks and not state.generated
        if shared:
            if state.prompt_top is None:
                state.blocks, state.cached = self.cache.cached_prefix(state.prompt_ids)
            else:  # a scored prompt: as far as its tokens' scores were published
                state.blocks, state.cached, scores = self.cache.scored_prefix(state.prompt_ids, state.prompt_top)
                state.take_scores(scores)
            state.from_cache = state.cached
        if not self._add_chunk(state, plan, budget, admitted=not waiting):
            if shared:
                self.cache.release(state.blocks)
                state.blocks, state.cached, state.from_cache = [], 0, 0
            return False
        if waiting:
            del self.waiting_requests[state.request_id]
            self.waiting_requests_order.remove(state.request_id)
            state.status = RequestStatus.PREFILLING
            self.active_requests[state.request_id] = state
        return True

    def awaits_prefix(self, state: RequestState) -> bool:
        """Whether the waiting request ``state`` had better wait for a prompt prefix an admitted
        request is computing (SGLang's in-batch prefix caching): that request, still computing its
        prompt, shares with ``state``'s at least a block and at least half of it, beyond what it took
        from the prompt cache, and will publish it usable by ``state`` (with scores of as many
        alternatives, for a scored prompt) within about the time ``state`` would take to compute its
        own prompt. Once published, ``state`` takes it from the prompt cache: the choices of one
        request, or the choices of a multiple-choice question sent together, compute their prompt
        once. A scheduler skips such a request this step (and goes on with the next)."""
        if not self.cache.allow_block_sharing or state.blocks or state.generated:
            return False
        prompt, need = state.prompt_ids, max(self.cache.block_size, len(state.prompt_ids) // 2)
        for other in self.active_requests.values():
            if other.status != RequestStatus.PREFILLING or not self._publishes_for(other, state):
                continue
            shared = other.from_cache + need  # the tokens the two prompts must share, compared at C speed
            if shared <= min(len(prompt), len(other.prompt_ids)) and prompt[:shared] == other.prompt_ids[:shared] \
                    and len(other.prompt_ids) - other.cached <= 2 * len(prompt):
                return True
        return False

    def _publishes_for(self, other: RequestState, state: RequestState) -> bool:
        """Whether ``other``'s published prompt is one ``state`` can take (a scored prompt needs its scores)."""
        return state.prompt_top is None or (
            other.prompt_top is not None and state.prompt_top <= other.prompt_top <= self.cache.max_published_top)

    def preempt(self, state: RequestState) -> None:
        """Free an active request's blocks and put it back at the front of the queue (it recomputes
        its tokens when it runs again)."""
        self.cache.release(state.blocks)
        state.blocks, state.cached = [], 0
        state.status = RequestStatus.PENDING
        del self.active_requests[state.request_id]
        self.waiting_requests[state.request_id] = state
        self.waiting_requests_order.appendleft(state.request_id)
        self.preempted += 1

    def _add_chunk(self, r: RequestState, plan: Plan, budget: Budget, *, admitted: bool) -> bool:
        n = min(r.pending, budget.tokens)
        chunk = getattr(r.config, "prefill_chunk_size", None) or self.prefill_chunk_size  # the request's own first
        if chunk:
            n = min(n, chunk)
        if r.scoring and r.score_chunk:  # every position's logits are kept: within the step's logits budget
            n = min(n, budget.scored_rows(r))
        if not budget.allows(r, n):
            return False
        need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        if need > self.cache.free_blocks:
            room = (len(r.blocks) + self.cache.free_blocks) * self.cache.block_size - r.cached
            if room < 1 and not (admitted and self._make_room(r, 1, plan, newer_only=True)):
                return False
            n = min(n, (len(r.blocks) + self.cache.free_blocks) * self.cache.block_size - r.cached)
            need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        r.blocks += self.cache.allocate(need)
        plan.append((r, n))
        budget.spend(r, n)
        return True

    def _grow(self, r: RequestState, n: int, plan: Plan) -> bool:
        need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        if not self._make_room(r, need, plan):
            return False
        if need > 0:
            r.blocks += self.cache.allocate(need)
        return True

    def _make_room(self, r: RequestState, need: int, plan: Plan, *, newer_only: bool = False) -> bool:
        """Preempt the most recently admitted other requests not in ``plan`` (only those admitted
        after ``r`` when ``newer_only``) until ``need`` blocks are free; whether they are."""
        while need > self.cache.free_blocks:
            planned = {id(p) for p, _ in plan}
            victims = [v for v in self.active_requests.values() if v is not r and id(v) not in planned
                       and (not newer_only or v.order > r.order)]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda v: v.order))
        return True


class FIFOScheduler(Scheduler):
    """Decoding requests first (one token each), then split prefills and new requests in arrival
    order, admitting new ones only while the free blocks stay above the safety margin (0.2 of the
    cache by default)."""

    default_safety_margin = 0.2

    def schedule_batch(self, token_budget: int, cache_budget: int | None = None) -> Plan | None:
        plan: Plan = []
        budget = self.budget(token_budget, cache_budget)
        for r in self.decoding_requests():
            if budget.tokens < 1 or budget.requests < 1:
                return plan
            self.schedule_decode(r, plan, budget)
        for r in self.prefilling_requests():
            if r.status != RequestStatus.PREFILLING:  # preempted by an older prefill of this step
                continue
            if not self.schedule_prefill(r, plan, budget):
                return plan
        for r in self.waiting_candidates():
            if self.awaits_prefix(r):
                continue
            if budget.tokens < 1 or not self.schedule_prefill(r, plan, budget, margin=True):
                break
        return plan


class PrefillFirstScheduler(Scheduler):
    """Split prefills first, then new requests in arrival order, then decoding requests with what
    is left of the budget (no safety margin by default)."""

    default_safety_margin = 0.0

    def schedule_batch(self, token_budget: int, cache_budget: int | None = None) -> Plan | None:
        plan: Plan = []
        budget = self.budget(token_budget, cache_budget)
        prefills_done = True
        for r in self.prefilling_requests():
            if r.status != RequestStatus.PREFILLING:  # preempted by an older prefill of this step
                continue
            if not self.schedule_prefill(r, plan, budget):
                prefills_done = False
                break
        if prefills_done:
            for r in self.waiting_candidates():
                if self.awaits_prefix(r):
                    continue
                if budget.tokens < 1 or not self.schedule_prefill(r, plan, budget, margin=self.safety_margin > 0):
                    break
        for r in self.decoding_requests():
            if budget.tokens < 1 or budget.requests < 1:
                break
            self.schedule_decode(r, plan, budget)
        return plan


def scheduler_class(name_or_class: Any) -> type[Scheduler]:
    """The scheduler class for a registered name (``register_schedulers``) or a :class:`Scheduler`
    subclass given as is."""
    if isinstance(name_or_class, type):
        if not issubclass(name_or_class, Scheduler):
            raise ConfigError(f"`scheduler` must be a registered scheduler name or a genkit.Scheduler subclass; got "
                              f"{name_or_class.__name__}")
        return name_or_class
    from ..plugins import get_registry

    cls = get_registry().get("scheduler", name_or_class).load()
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigError(f"the scheduler registered as {name_or_class!r} is not a genkit.Scheduler subclass: {cls!r}")
    return cls


def scheduler_from(config: Any, cache: BlockAllocator, prefill_chunk_size: int | None) -> Scheduler:
    """The scheduler a :class:`~genkit.continuous.ContinuousBatchingConfig` asks for."""
    cls = scheduler_class(config.scheduler if config.scheduler is not None else config.scheduler_type)
    return cls(cache, config.safety_margin, config.max_requests_per_batch, prefill_chunk_size=prefill_chunk_size)
