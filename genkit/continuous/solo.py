"""A request running alone in continuous batching, decoded as batch-1 greedy ``generate`` decodes it.

A continuous-batching step runs each running request's next token as a row of one product: with one
request, one row, one token per step. Batch-1 greedy ``generate`` on a float32 model drafts tokens
with an 8-bit copy of the model and checks them in one step (:mod:`genkit.models.self_speculation`):
the same tokens, about twice as many per second. So when a plain greedy request (no logits
processor, no log-probabilities, stopped by its EOS ids and its length only) is the only one running
and nothing waits, the manager hands it to :class:`SoloDecoder`: its keys and values are read out of
its blocks into a contiguous cache (the model's ``speculating_cache``), it decodes there by the
model's ``greedy_step`` until it finishes or the manager has something else to do (a request
arrives, it is cancelled, the manager stops or pauses), and the positions it computed go back into
its blocks (allocated as it goes), so that batching goes on from there, or the prompt cache keeps
them. A model whose steps would not speculate (``model.self_speculation = False``, a quantized model,
a transformers model) is never handed a request again after the first try.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from genkit.strategy.finish import eos_or_length

from .requests import RequestState

__all__ = ["MIN_LEFT", "SoloDecoder", "take_greedy"]

MIN_LEFT = 8  # a request with fewer new tokens left stays in the batch: copying its cache would not pay
AHEAD_ROOM = 512  # positions a copied cache holds beyond the request's tokens when it is made
ROOM = 16  # positions a round of drafts may compute past the length (genkit.models.self_speculation)


def take_greedy(r: RequestState, token: int) -> bool:
    """Record ``r``'s greedy ``token``; whether it finishes ``r``
    (:func:`~genkit.strategy.finish.eos_or_length`, ``generate``'s decision for these stop
    conditions; the reason is recorded)."""
    r.generated.append(token)
    r.finish_reason = eos_or_length(r.stop, r.length, token)
    return r.finish_reason is not None


class SoloDecoder:
    """Decodes a request alone on ``model``'s self-speculating greedy steps (see the module
    docstring); ``store`` is the paged K/V store, ``scheduler`` the manager's (which grows a
    request's blocks).

    The contiguous cache of the last request decoded alone is kept: that request, back alone after
    batched steps, copies only the positions those steps computed; another request refills its
    buffers where they are large enough (fresh memory costs its page faults: SmolLM2's cache of 3000
    positions took ~90 ms to copy into new buffers, ~45 ms into used ones), until the manager's loop
    ends (:meth:`release`)."""

    def __init__(self, model: Any, store: Any, scheduler: Any) -> None:
        self.model, self.store, self.scheduler = model, store, scheduler
        self.available = all(callable(getattr(model, name, None))
                             for name in ("speculating_cache", "speculation_draft", "greedy_step"))
        self.tokens = 0  # tokens decoded alone
        self._cache: Any = None  # the last request's cache, and (its id, its blocks) while it may come back
        self._owner: tuple[str, list[int]] | None = None
        self._prepared = False  # (prepare() ran)

    def wants(self, r: RequestState) -> bool:
        """Whether ``r`` (running alone, plain greedy, decoding) has enough tokens left to go alone."""
        return self.available and r.max_new_tokens - len(r.generated) >= MIN_LEFT

    def forget(self, request_id: str) -> None:
        """``request_id`` ended (its cache's buffers stay for the next request)."""
        if self._owner is not None and self._owner[0] == request_id:
            self._owner = None

    @torch.inference_mode()
    def prepare(self) -> None:
        """Make the model's draft now (the manager's loop calls this once, while idle), so that the
        first request to run alone does not wait for it mid-stream (SmolLM2's took 0.4-1.2 s on 2
        cores); a model whose steps would not speculate is marked so."""
        if self.available and not self._prepared:
            self._prepared = True
            self.available = self.model.speculation_draft(self.store.prepared) is not None

    def release(self) -> None:
        """Let the kept cache go (the manager's loop ended)."""
        self._cache, self._owner = None, None

    @torch.inference_mode()  # as the paged forward
    def run(self, r: RequestState, interrupted: Callable[[], bool], emit: Callable[[RequestState], None]) -> bool:
        """Decode ``r`` until it finishes (True) or ``interrupted()`` (False); ``emit(r)`` after each
        token that does not finish it. Its blocks hold every position computed when this returns."""
        cache, fresh = self._cache_for(r)
        if cache is None:
            self.available = False
            return False
        start, finished = r.cached, False
        try:
            while not interrupted() and self.scheduler._grow(r, 1, []):  # blocks for its next position
                token = self.model.greedy_step(torch.tensor([[r.generated[-1]]]), None, None, cache)
                if token is None:  # the model declined the step (nothing was written): a kept cache
                    self.available = not fresh  # may be stale (weights rebuilt), a fresh one is not
                    cache = None
                    break
                r.cached += 1
                self.tokens += 1
                finished = take_greedy(r, int(token[0]))
                if r.record_timestamps:
                    r.timestamps.append(time.perf_counter())
                if finished:
                    break
                if r.streaming:
                    emit(r)
        finally:
            if cache is not None:
                self._write_back(cache, r, start)
            self._cache = cache
            self._owner = None if cache is None else (r.request_id, list(r.blocks))  # (forgotten when it ends)
        return finished

    def _cache_for(self, r: RequestState) -> tuple[Any, bool]:
        """(``r``'s cache, whether it was made now): the kept one brought up to date where ``r`` left
        it, else one filled from its blocks (into the kept buffers where they are large enough)."""
        owner, cache = self._owner, self._cache
        self._owner = None
        if (owner is not None and owner[0] == r.request_id and r.blocks[:len(owner[1])] == owner[1]
                and cache.get_seq_length() <= r.cached):
            self.model.extend_speculating_cache(cache, self.store, r.blocks, r.cached)
            return cache, False
        # room for the tokens left, up to AHEAD_ROOM more than it holds (the cache grows past that as a
        # generate's does): a long limit does not reserve a second copy of its whole cache at once
        left = min(r.max_new_tokens - len(r.generated), AHEAD_ROOM)
        return self.model.speculating_cache(self.store, r.blocks, r.cached, r.length + left + ROOM, cache), True

    def _write_back(self, cache: Any, r: RequestState, start: int) -> None:
        """Positions ``start..r.cached-1`` of ``cache`` into ``r``'s blocks."""
        if r.cached <= start:
            return
        slots = self.store.slots(r.blocks, start, r.cached)
        for layer in range(len(self.store.keys)):
            k, v = cache.layer(layer)
            self.store.write(layer, slots, k[0, :, start:r.cached], v[0, :, start:r.cached])
