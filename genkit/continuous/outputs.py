"""Where a manager's outputs wait for their reader: each output is taken exactly once, whether it is
read as "the next output" (``get_result()``, iteration), as "the next output of this request"
(``get_result(request_id)``, ``request_id_iter``) or handed to a registered handler, from any
number of threads; the thread that delivers can give a reader waiting for outputs its core until it
has taken them (:meth:`OutputRouter.yield_to_readers`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .requests import GenerationOutput

__all__ = ["YIELD_TIMEOUT", "OutputRouter"]

# the longest a delivering thread gives its core to a reader (OutputRouter.yield_to_readers): a reader
# waiting for outputs takes them and is back waiting in 0.1-0.3 ms when it has a core
YIELD_TIMEOUT = 0.002


class _Entry:
    __slots__ = ("out",)

    def __init__(self, out: GenerationOutput) -> None:
        self.out: GenerationOutput | None = out  # None once taken


class OutputRouter:
    """One queue of outputs in publication order, indexed by request. ``alive()`` tells whether
    more outputs may come (a reader stops waiting when it says no and nothing is queued)."""

    def __init__(self, alive: Callable[[], bool]) -> None:
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # readers wait here for outputs
        self._back = threading.Condition(lock)  # a thread in yield_to_readers waits here for a reader
        self._waiting = 0  # readers waiting in take() now
        self._waits = 0  # times a reader began to wait
        self.yield_timeout = YIELD_TIMEOUT  # yield_to_readers' default
        self._all: deque[_Entry] = deque()
        self._by_id: dict[str, deque[_Entry]] = {}
        self._taken_in_all = 0  # entries of _all already taken through _by_id
        self._handlers: dict[str, Callable[[GenerationOutput], None]] = {}
        self._alive = alive

    def deliver(self, out: GenerationOutput) -> None:
        self.deliver_all([out])

    def deliver_all(self, outs: list[GenerationOutput]) -> None:
        """:meth:`deliver` each of ``outs`` in order, waking the readers once (a step's outputs)."""
        handled = []
        with self._cond:
            for out in outs:
                handler = self._handlers.get(out.request_id)
                if handler is None:
                    entry = _Entry(out)
                    self._all.append(entry)
                    self._by_id.setdefault(out.request_id, deque()).append(entry)
                    continue
                if out.is_finished():
                    del self._handlers[out.request_id]
                handled.append((handler, out))
            if len(handled) < len(outs):
                self._cond.notify_all()
        for handler, out in handled:
            handler(out)

    def yield_to_readers(self, timeout: float | None = None) -> bool:
        """Block the calling thread -- the one that delivers, e.g. continuous batching's loop before
        its next step -- until a reader that was waiting for outputs has taken what it could and
        waits again, or ``timeout`` seconds pass (default :attr:`yield_timeout`,
        :data:`YIELD_TIMEOUT`); at once when no reader is waiting or no output waits for one (a
        handler's ran already). Whether a reader came back.

        Why: the steps' threads keep every core busy (one computes, its OpenMP workers spin between
        parallel regions), so a reader woken by :meth:`deliver_all` waited for the scheduler to
        preempt one of them, 2-5 ms on 2 cores under Linux's EEVDF, before it could pass a
        request's first token on (``genkit serve``'s time to first token); blocked here, this thread
        leaves its core to the reader, which took the outputs 0.1-0.2 ms after they were chosen."""
        with self._cond:
            if self._waiting == 0 or self.empty():  # no reader, or nothing for one (the lock is re-entrant)
                return False
            start = self._waits
            return self._back.wait_for(lambda: self._waits > start, self.yield_timeout if timeout is None else timeout)

    def wake(self) -> None:
        """Wake every waiting reader (the manager stopped)."""
        with self._cond:
            self._cond.notify_all()

    def take(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The oldest output not yet taken (of ``request_id`` when given); None after ``timeout``
        seconds (without a timeout: at once when nothing is queued and no output can come any more)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                out = self._pop(request_id)
                if out is not None:
                    return out
                if deadline is None and not self._alive():
                    return None
                wait = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                if wait <= 0:
                    return None
                self._waiting += 1
                self._waits += 1
                self._back.notify_all()  # a thread yielding to readers goes on: this one has taken what it could
                try:
                    self._cond.wait(wait)
                finally:
                    self._waiting -= 1

    def take_all(self, timeout: float | None = None) -> list[GenerationOutput]:
        """Every output not yet taken, oldest first, once there is one; [] after ``timeout``
        seconds (as :meth:`take`: without a timeout, at once when none can come any more). A reader
        of every request takes a whole step's outputs in one call."""
        first = self.take(None, timeout)
        if first is None:
            return []
        outs = [first]
        with self._cond:
            while True:
                out = self._pop(None)
                if out is None:
                    return outs
                outs.append(out)

    def empty(self) -> bool:
        with self._cond:
            return len(self._all) == self._taken_in_all

    def set_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Hand ``request_id``'s outputs to ``callback`` (those already queued first) until it
        finishes."""
        with self._cond:
            queued = []
            while True:
                out = self._pop(request_id)
                if out is None:
                    break
                queued.append(out)
            if not any(o.is_finished() for o in queued):
                self._handlers[request_id] = callback
        for out in queued:
            callback(out)

    def _pop(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is None:
            while self._all:
                entry = self._all.popleft()
                if entry.out is None:
                    self._taken_in_all -= 1
                    continue
                out, entry.out = entry.out, None
                mine = self._by_id[out.request_id]  # the entry is the first one left there too
                while mine and mine[0].out is None:
                    mine.popleft()
                if not mine:
                    del self._by_id[out.request_id]
                return out
            return None
        mine = self._by_id.get(request_id)
        if not mine:
            return None
        entry = mine.popleft()
        if not mine:
            del self._by_id[request_id]
        out, entry.out = entry.out, None
        self._taken_in_all += 1
        if self._taken_in_all > 1024 and self._taken_in_all * 2 > len(self._all):
            self._all = deque(e for e in self._all if e.out is not None)
            self._taken_in_all = 0
        return out


def call_in_loop(callback: Callable[[GenerationOutput], None]) -> Callable[[GenerationOutput], None]:
    """``callback`` run on the asyncio loop running now (as transformers' ``register_result_handler``
    does), or as is when no loop runs in this thread."""
    import asyncio

    try:
        loop: Any = asyncio.get_running_loop()
    except RuntimeError:
        return callback
    return lambda out: loop.call_soon_threadsafe(callback, out)
