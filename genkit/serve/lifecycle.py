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

from ..errors import ConfigError

logger = logging.getLogger("genkit.serve")

__all__ = ["DrainingServer", "bind", "connection_limits"]

_CANCEL_GRACE = 5.0  # seconds cancelled requests get to end before the server closes anyway
KEEP_ALIVE_SECONDS = 5  # an idle keep-alive connection is closed after this (uvicorn's default)
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers at most this big (h11's default), else a 400


def connection_limits(max_connections: int | None, max_concurrent_requests: int) -> dict[str, Any]:
    """uvicorn's settings bounding the connections (``--max-connections``; default
    :func:`genkit.serve.admission.default_max_connections`): past it a request is answered 503. uvicorn
    counts the connection a request came on among the open ones, hence the + 1: ``max_connections``
    connections are served."""
    from .admission import default_max_connections

    limit = max_connections if max_connections is not None else default_max_connections(max_concurrent_requests)
    return {"limit_concurrency": limit + 1, "timeout_keep_alive": KEEP_ALIVE_SECONDS,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


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
