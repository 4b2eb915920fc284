"""Schedulers: which requests run in the next batching step, and how many of their tokens.

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
prompt and what it generated so far (its tokens are kept).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import ConfigError
from .block_allocator import BlockAllocator
from .requests import RequestState, RequestStatus

__all__ = ["SCHEDULERS", "Scheduler"]

SCHEDULERS = ("fifo", "prefill_first")


class Scheduler:
    def __init__(self, kind: str, cache: BlockAllocator, *, max_batch_tokens: int, max_requests: int,
                 prefill_chunk_size: int | None = None, safety_margin: float | None = None) -> None:
        if kind not in SCHEDULERS:
            raise ConfigError(f"`scheduler_type` must be one of {', '.join(repr(s) for s in SCHEDULERS)}; got {kind!r}")
        self.kind, self.cache = kind, cache
        self.max_batch_tokens, self.max_requests = max_batch_tokens, max_requests
        self.prefill_chunk_size = prefill_chunk_size
        self.safety_margin = 0.2 if safety_margin is None else safety_margin
        self.preempted = 0

    def schedule(self, waiting: deque[RequestState], active: list[RequestState]) -> list[tuple[RequestState, int]]:
        """The requests of the next step with their token counts; admits waiting requests into
        ``active`` and allocates their blocks."""
        plan: list[tuple[RequestState, int]] = []
        budget = [self.max_batch_tokens]
        decoding = [r for r in active if r.status == RequestStatus.DECODING]
        if self.kind == "fifo":
            self._decodes(decoding, active, waiting, plan, budget)
            self._prefills(waiting, active, plan, budget, margin=True)
        else:
            self._prefills(waiting, active, plan, budget, margin=False)
            self._decodes(decoding, active, waiting, plan, budget)
        return plan

    # -- decode: one token per request ------------------------------------------------------------
    def _decodes(self, decoding: list[RequestState], active: list[RequestState], waiting: deque[RequestState],
                 plan: list[tuple[RequestState, int]], budget: list[int]) -> None:
        for r in sorted(decoding, key=lambda r: r.order):
            if budget[0] < 1 or len(plan) >= self.max_requests:
                return
            if r not in active:  # preempted by an earlier request of this loop
                continue
            if not self._grow(r, r.pending, active, waiting, plan):
                continue
            plan.append((r, r.pending))
            budget[0] -= r.pending

    # -- prefill: prompt tokens, possibly split over steps ---------------------------------------
    def _prefills(self, waiting: deque[RequestState], active: list[RequestState],
                  plan: list[tuple[RequestState, int]], budget: list[int], margin: bool) -> None:
        prefilling = sorted((r for r in active if r.status == RequestStatus.PREFILLING), key=lambda r: r.order)
        for r in prefilling:
            if not self._add_chunk(r, active, plan, budget, admit=False, margin=False):
                return
        while waiting and budget[0] > 0 and len(plan) < self.max_requests:
            r = waiting[0]
            if margin and self.cache.free_blocks - self.cache.blocks_for(min(r.pending, budget[0])) < \
                    self.safety_margin * self.cache.num_blocks and active:
                return
            if not r.blocks and not r.generated:
                r.blocks = self.cache.shared_prefix(r.prompt_ids)
                r.cached = len(r.blocks) * self.cache.block_size
            if not self._add_chunk(r, active, plan, budget, admit=True, margin=margin):
                self.cache.release(r.blocks)  # shared prefix blocks taken above
                r.blocks, r.cached = [], 0
                return
            waiting.popleft()

    def _add_chunk(self, r: RequestState, active: list[RequestState], plan: list[tuple[RequestState, int]],
                   budget: list[int], *, admit: bool, margin: bool) -> bool:
        n = min(r.pending, budget[0])
        if self.prefill_chunk_size:
            n = min(n, self.prefill_chunk_size)
        if n < 1 or len(plan) >= self.max_requests:
            return False
        need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        if need > self.cache.free_blocks:
            n = (len(r.blocks) + self.cache.free_blocks) * self.cache.block_size - r.cached
            if n < 1:
                return False
            need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        r.blocks += self.cache.allocate(need)
        if admit:
            r.status = RequestStatus.PREFILLING
            active.append(r)
        plan.append((r, n))
        budget[0] -= n
        return True

    # -- blocks for a growing request, preempting if needed --------------------------------------
    def _grow(self, r: RequestState, n: int, active: list[RequestState], waiting: deque[RequestState],
              plan: list[tuple[RequestState, int]]) -> bool:
        need = self.cache.blocks_for(r.cached + n) - len(r.blocks)
        while need > self.cache.free_blocks:
            planned = {id(p) for p, _ in plan}
            victims = [v for v in active if v is not r and id(v) not in planned]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda v: v.order), active, waiting)
        if need > 0:
            r.blocks += self.cache.allocate(need)
        return True

    def preempt(self, r: RequestState, active: list[RequestState], waiting: deque[RequestState]) -> None:
        self.cache.release(r.blocks)
        r.blocks, r.cached = [], 0
        r.status = RequestStatus.PENDING
        active.remove(r)
        waiting.appendleft(r)
        self.preempted += 1


def scheduler_from(config: Any, cache: BlockAllocator, prefill_chunk_size: int | None) -> Scheduler:
    return Scheduler(config.scheduler_type, cache, max_batch_tokens=config.max_batch_tokens,
                     max_requests=config.max_requests_per_batch, prefill_chunk_size=prefill_chunk_size,
                     safety_margin=config.safety_margin)
