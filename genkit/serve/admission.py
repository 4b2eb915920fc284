"""Admission control of ``genkit serve``: how many generation requests it takes at once, and how
long each may run.

A completion or chat completion takes a slot once its body is read and before it is tokenized or
queued; with ``max_concurrent_requests`` slots taken (running and waiting requests, on either
engine), one more is refused at once with a 429 (OpenAI's error object, ``code``
``"server_overloaded"``) and a ``Retry-After`` header, as TGI's ``--max-concurrent-requests``
does. The slot is given back when the response ends, whichever way it ends. ``/health``,
``/metrics``, ``/v1/models``, ``/version``, ``/tokenize`` and ``/detokenize`` take none.

``request_timeout`` (seconds, from the slot's taking): a request still running then is cancelled
in its engine (its cache blocks freed) and its slot given back; a stream ends there with
``finish_reason`` ``"length"`` (what a limit gives, as ``max_time`` does), a response not yet
begun is a 504 (``code`` ``"request_timeout"``). A stream whose send is still waiting then (its
client does not read: :class:`SendDeadline`) is cut, its connection closed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import ConfigError
from .openai_api import APIError

__all__ = ["ABORT_EXTENSION", "DEFAULT_MAX_CONCURRENT_REQUESTS", "Admission", "SendDeadline", "Slot",
           "default_max_connections"]

DEFAULT_MAX_CONCURRENT_REQUESTS = 128  # TGI's default
RETRY_AFTER_SECONDS = 1
# the ASGI scope extension (``scope["extensions"][ABORT_EXTENSION]``, a callable) that closes the
# request's connection at once, what was not sent dropped: genkit.serve.lifecycle.TimeoutProtocol
# gives it to every request
ABORT_EXTENSION = "genkit.abort"


def default_max_connections(max_concurrent_requests: int) -> int:
    """Open connections allowed by default: one per admitted request, as many again for clients
    being refused, idle keep-alive connections and retries, and 64 for probes (``/health``, ``/metrics``)."""
    return 2 * max_concurrent_requests + 64


class Slot:
    """One admitted request's place; :meth:`release` gives it back (once, whoever calls it)."""

    def __init__(self, admission: Admission, deadline: float | None) -> None:
        self.admission, self.deadline = admission, deadline
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.admitted -= 1

    def remaining(self) -> float | None:
        """Seconds left before the request timeout (None: no timeout; never below 0)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def timed_out(self) -> APIError:
        """Count a timeout; the error a response not yet begun answers."""
        self.admission.timed_out += 1
        return APIError(f"the request ran longer than this server's --request-timeout of "
                        f"{self.admission.request_timeout:g} seconds and was stopped", status=504,
                        type_="server_error", code="request_timeout")


class Admission:
    """The slots of a server (used on its event loop only: no lock). ``admitted``: slots taken now;
    ``refused``: requests answered 429; ``timed_out``: requests stopped by ``request_timeout``."""

    def __init__(self, max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 request_timeout: float | None = None) -> None:
        if isinstance(max_concurrent_requests, bool) or not isinstance(max_concurrent_requests, int) \
                or max_concurrent_requests < 1:
            raise ConfigError(f"`max_concurrent_requests` must be an int >= 1; got {max_concurrent_requests!r}")
        if request_timeout is not None and (isinstance(request_timeout, bool)
                                            or not isinstance(request_timeout, (int, float))
                                            or not 0 < request_timeout < float("inf")):
            raise ConfigError(f"`request_timeout` must be a number of seconds > 0, or None; got {request_timeout!r}")
        self.max_concurrent_requests, self.request_timeout = max_concurrent_requests, request_timeout
        self.admitted = self.refused = self.timed_out = 0

    def admit(self) -> Slot:
        """A slot, or the 429 :class:`APIError` when every slot is taken."""
        if self.admitted >= self.max_concurrent_requests:
            self.refused += 1
            raise APIError(f"the server is at its limit of {self.max_concurrent_requests} concurrent requests "
                           "(--max-concurrent-requests); retry later", status=429, type_="server_error",
                           code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        self.admitted += 1
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        return Slot(self, deadline)

    def metrics(self) -> dict[str, int]:
        """The samples ``/metrics`` reports (``genkit_`` + name)."""
        return {"requests_admitted": self.admitted, "requests_refused": self.refused,
                "requests_timed_out": self.timed_out, "max_concurrent_requests": self.max_concurrent_requests}


async def within(awaitable: Any, slot: Slot) -> Any:
    """``awaitable``'s result, or :class:`asyncio.TimeoutError` once ``slot``'s deadline passes."""
    remaining = slot.remaining()
    if remaining is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, remaining)


class SendDeadline:
    """The sends of a streamed response, watched against ``slot``'s request timeout: a send still
    waiting when it passes, or one begun after it that does not return at once, calls ``on_stuck``
    (once). A send waits only while the client does not read (the server's buffer for the connection
    is full), so a send that has not returned by the event loop's next turn is waiting. Without a
    request timeout the sends are not watched."""

    def __init__(self, slot: Slot, on_stuck: Any) -> None:
        self.on_stuck = on_stuck
        self.sending = self.expired = self.stuck = False
        remaining = slot.remaining()
        self.timer = None if remaining is None else asyncio.get_running_loop().call_later(remaining, self._expire)

    def wrap(self, send: Any) -> Any:
        if self.timer is None:
            return send

        async def watched(message: Any) -> None:
            if self.expired:  # past the timeout: a send that waits is cut once the loop turns
                asyncio.get_running_loop().call_soon(self._check)
            self.sending = True
            try:
                await send(message)
            finally:
                self.sending = False
        return watched

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _expire(self) -> None:
        self.expired = True
        self._check()

    def _check(self) -> None:
        if self.sending and not self.stuck:
            self.stuck = True
            self.on_stuck()
