"""Wall-clock limits on Hub HTTP requests (genkit's own reads of recipes, and ``huggingface_hub``'s
model and config downloads).

The HTTP library's timeouts are per read: a server that sends its headers or body a byte every few
seconds never trips them. So each request gets a :class:`Watch` (its httpcore ``trace`` extension)
that keeps the request's sockets and shuts them down when its wall-clock time is up, which wakes the
blocked read; the request then fails with a :class:`HubTimeout` naming the request and the limit.

Settings (read at call time): ``GENKIT_HUB_TIMEOUT`` (10 s per read; an answer gets
:data:`DEADLINE_FACTOR` times that) and ``GENKIT_MODEL_DOWNLOAD_TIMEOUT`` (3600 s for a whole model
or config download); ``HF_HUB_DOWNLOAD_TIMEOUT`` / ``HF_HUB_ETAG_TIMEOUT`` keep bounding the Hub
client's reads as they always do.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError

#: a whole answer (headers and body; a model file's headers) must arrive within this many times GENKIT_HUB_TIMEOUT s
DEADLINE_FACTOR = 6


def seconds_setting(name: str, default: str) -> float:
    """A number of seconds from the environment variable ``name``: finite and > 0, else an error naming it."""
    raw = os.environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}={raw!r} is not accepted; use a number of seconds > 0")
    return value


def hub_timeout() -> float:
    """Seconds per read of a Hub answer (``GENKIT_HUB_TIMEOUT``, default 10): a finite number > 0."""
    return seconds_setting("GENKIT_HUB_TIMEOUT", "10")


def model_download_timeout() -> float:
    """Seconds one model or tokenizer download from the Hub may take in all
    (``GENKIT_MODEL_DOWNLOAD_TIMEOUT``, default 3600)."""
    return seconds_setting("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "3600")


class HubTimeout(TimeoutError):
    """A Hub request ran past its wall-clock limit; the message names the request and the limit.
    ``total``: the limit of a whole recipe load or model download (not worth another try)."""

    def __init__(self, message: str, total: bool) -> None:
        super().__init__(message)
        self.total = total


class Deadline:
    """A wall-clock limit on all the Hub traffic of one recipe load or model download, named in
    errors by ``what`` and the environment variable ``setting`` that sets it."""

    def __init__(self, seconds: float, setting: str, what: str) -> None:
        self.seconds, self.setting, self.what = seconds, setting, what
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        return self.at - time.monotonic()


class Watch:
    """The httpcore ``trace`` extension of one request and its redirects. It keeps the sockets the
    request opens and shuts them down when its time is up: ``per_request`` seconds after it started
    (for the headers only when ``headers_only``, else for the whole answer) or the total ``deadline``,
    whichever comes first. That wakes a read the server keeps alive a byte at a time, and the request
    fails with the :class:`HubTimeout` this raises from the trace."""

    def __init__(self, url: str, per_request: float, deadline: Deadline | None, headers_only: bool) -> None:
        self.url, self.per_request, self.deadline, self.headers_only = url, per_request, deadline, headers_only
        self.sockets: list[socket.socket] = []
        self.timer: threading.Timer | None = None
        self.error: HubTimeout | None = None
        self.waiting = False  # for the answer (its headers only, when headers_only)
        self.lock = threading.Lock()

    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(("connect_tcp.complete", "connect_unix_socket.complete")):
            with self.lock:
                self.sockets.append(info["return_value"].get_extra_info("socket"))
            if self.error is not None:
                self._shutdown()
        if "close" in event:  # never stands in the way of closing
            if event.endswith("response_closed.complete") and self.headers_only:
                self.waiting = False
                self.cancel()
            return
        if not event.endswith((".started", ".failed")):
            if event.endswith("receive_response_headers.complete") and self.headers_only:
                self.waiting = False
                self.cancel()
                self._arm(per_request=False)  # the body: the total deadline only
            return
        if self.error is None and self.deadline is not None and self.deadline.left() <= 0:
            self._fire(True)
        if self.error is not None:
            raise self.error
        if event.endswith(("connect_tcp.started", "send_request_headers.started")) and not self.waiting:
            self.waiting = True
            self.cancel()
            self._arm(per_request=True)

    def _arm(self, per_request: bool) -> None:
        left = float("inf") if self.deadline is None else self.deadline.left()
        seconds = min(self.per_request, left) if per_request else left
        if seconds < float("inf"):
            self.timer = threading.Timer(max(seconds, 0.0), self._fire, (seconds == left,))
            self.timer.daemon = True
            self.timer.start()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self, total: bool) -> None:
        if self.error is None:
            self.error = HubTimeout(self.message(total), total)
        self._shutdown()

    def message(self, total: bool) -> str:
        path = urlsplit(self.url).path
        if total and self.deadline is not None:
            return (f"GET {path} stopped: {self.deadline.what} did not finish within {self.deadline.seconds:g} s "
                    f"({self.deadline.setting})")
        part = "sent no complete answer headers" if self.headers_only else "did not finish"
        return f"GET {path} {part} within {self.per_request:g} s ({DEADLINE_FACTOR} x GENKIT_HUB_TIMEOUT)"

    def _shutdown(self) -> None:
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed


def client_factory() -> Callable[[], Any]:
    """What makes the Hub client's HTTP clients (``huggingface_hub.set_client_factory``'s, else its default)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) or _http.default_client_factory


_DOWNLOADS = threading.RLock()


@contextmanager
def download_deadline(what: str) -> Iterator[Deadline]:
    """Bound every request ``huggingface_hub`` makes in the block (``snapshot_download``,
    ``hf_hub_download``): its answer headers within :data:`DEADLINE_FACTOR` x ``GENKIT_HUB_TIMEOUT``
    seconds, all of them (bodies included) within ``GENKIT_MODEL_DOWNLOAD_TIMEOUT`` seconds; past
    either, a :class:`HubTimeout` naming the request and the limit (the library's own per-read
    timeouts, ``HF_HUB_DOWNLOAD_TIMEOUT`` and ``HF_HUB_ETAG_TIMEOUT``, still apply). The requests go
    through a client of their own for the block (made by the client factory in use, so proxies and
    certificates are kept), one connection each, so a watch knows its request's socket. One guarded
    download at a time in a process; other threads' Hub client requests meanwhile share the limits."""
    import huggingface_hub

    deadline = Deadline(model_download_timeout(), "GENKIT_MODEL_DOWNLOAD_TIMEOUT", what)
    per_request = DEADLINE_FACTOR * hub_timeout()

    def watch(request: Any) -> None:
        if not isinstance(request.extensions.get("trace"), Watch):  # a redirect keeps its request's watch
            request.extensions = {**request.extensions, "trace": Watch(str(request.url), per_request, deadline, True)}
            request.headers["Connection"] = "close"

    with _DOWNLOADS:
        previous = client_factory()

        def factory() -> Any:
            client = previous()
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "request": [*hooks.get("request", []), watch]}
            return client

        huggingface_hub.set_client_factory(factory)
        try:
            yield deadline
        finally:
            huggingface_hub.set_client_factory(previous)




__all__ = ["DEADLINE_FACTOR", "Deadline", "HubTimeout", "Watch", "client_factory", "download_deadline", "hub_timeout",
           "model_download_timeout", "seconds_setting"]
