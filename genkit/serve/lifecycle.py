"""Start and stop of ``genkit serve``: the listening socket bound before the model loads, and a
graceful shutdown.

On SIGINT or SIGTERM the server drains: ``/health`` answers 503 and new requests are refused
(503) while the connection stays open; running requests finish, or are cancelled when
``shutdown_timeout`` has passed; then uvicorn closes and the process exits 0. A second SIGINT
cancels the running requests at once. No signal is re-raised afterwards (no traceback).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError
from .admission import ABORT_EXTENSION

logger = logging.getLogger("genkit.serve")

__all__ = ["DEFAULT_WRITE_TIMEOUT_SECONDS", "DrainingServer", "TimeoutProtocol", "bind",
           "connection_limits"]

_CANCEL_GRACE = 5.0  # seconds cancelled requests get to end before the server closes anyway
KEEP_ALIVE_SECONDS = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers at most this big (h11's default), else a 400
HEAD_TIMEOUT_SECONDS = 10.0  # a request line and headers must have arrived this long after the connection opened
DEFAULT_WRITE_TIMEOUT_SECONDS = 60.0  # --write-timeout: a response the client does not read for this long is cut


def connection_limits(max_connections: int | None, max_concurrent_requests: int,
                      head_timeout: float = HEAD_TIMEOUT_SECONDS,
                      write_timeout: float = DEFAULT_WRITE_TIMEOUT_SECONDS) -> dict[str, Any]:
    """uvicorn's settings bounding the connections (``--max-connections``; default
    :func:`genkit.serve.admission.default_max_connections`): past it a request is answered 503. uvicorn
    counts the connection a request came on among the open ones, hence the + 1: ``max_connections``
    connections are served. A connection is closed when its request head has not arrived
    ``head_timeout`` seconds after it opened or after its last response, or when its client has not
    read its response for ``write_timeout`` seconds (``--write-timeout``; :class:`TimeoutProtocol`)."""
    from .admission import default_max_connections

    limit = max_connections if max_connections is not None else default_max_connections(max_concurrent_requests)
    protocol = type("TimeoutProtocol", (TimeoutProtocol,), {"head_timeout": head_timeout,
                                                            "write_timeout": write_timeout})
    return {"limit_concurrency": limit + 1, "timeout_keep_alive": KEEP_ALIVE_SECONDS,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES, "http": protocol}


class TimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with two more timeouts, each closing the connection:

    - **head**: its request line and headers have not all arrived ``head_timeout`` seconds after it
      opened or after its previous response. uvicorn times out only a keep-alive connection that
      sends nothing after a response: a connection that never sends, or sends its head a byte at a
      time (slowloris), stays open for good, and a few hundred of them would hold every connection
      ``--max-connections`` allows.
    - **write**: its client has not read what the server wrote for ``write_timeout`` seconds (the
      transport's buffer stayed over its high-water mark, so a send of the response waits: uvicorn
      has no write timeout, and a client that stops reading a stream held its request's slot and its
      connection for good). The connection is aborted (what was not sent is dropped: a closed
      socket would wait for the client to read it), so the response sees its client gone: a stream
      is cancelled in its engine and its slot given back (genkit.serve.app).

    Each request's scope gets ``scope["extensions"][ABORT_EXTENSION]``, which aborts the connection
    (genkit.serve.app cuts a stream whose send outlasts ``--request-timeout`` with it)."""

    head_timeout = HEAD_TIMEOUT_SECONDS
    write_timeout = DEFAULT_WRITE_TIMEOUT_SECONDS
    _head_timer: Any = None
    _write_timer: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        app = self.app

        async def with_abort(scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("extensions", {})[ABORT_EXTENSION] = self.abort
            await app(scope, receive, send)
        self.app = with_abort

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is over its high-water mark: the client has that long to read it."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def abort(self) -> None:
        """Close the connection at once, dropping what was not sent."""
        self.transport.abort()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            return  # its head came: a request is being answered
        if not self.transport.is_closing():
            logger.debug("closing a connection whose request head did not arrive within %ss", self.head_timeout)
            self.transport.close()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        logger.info("closing a connection whose client did not read its response for %gs (--write-timeout)",
                    self.write_timeout)
        self.abort()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (before the model loads: a port in use is said at once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address this machine can listen on: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror} (--host / --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain of the module docstring; ``state`` is the app's
    :class:`~genkit.serve.app.ServerState`."""

    def __init__(self, config: uvicorn.Config, state: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.drain_deadline: float | None = None
        self.cancelled = False

    def handle_exit(self, sig: int, frame: Any) -> None:  # the signal handler: no re-raise afterwards
        if self.drain_deadline is None:
            logger.warning("shutting down: finishing %d running request(s) (at most %ss)",
                           len(self.state.inflight), self.shutdown_timeout)
            self.state.shutting_down = True
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
        elif not self.cancelled:  # a second signal: cancel now
            self.drain_deadline = 0.0

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.drain_deadline is None:
            return False
        now = time.monotonic()
        if self.state.inflight and now >= self.drain_deadline:
            logger.warning("cancelling %d running request(s)", len(self.state.inflight))
            self.state.cancel_inflight()
            self.drain_deadline = now + _CANCEL_GRACE  # cancelled: they end at their next step
            self.cancelled = True
        return not self.state.inflight or (self.cancelled and now >= self.drain_deadline)
