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

A download's limits are its own: the Hub client's HTTP clients get event hooks and a transport in
front of theirs, once (:func:`download_deadline`), that act only on the requests of a download under
way, found by the context they are made in or by the header :data:`DOWNLOAD_HEADER` (which reaches
the Hub client's worker threads, and is taken off before a request is sent). So are a download's
``proxies``: its requests go through them, the others do not.

A bounded download keeps off Xet storage: ``hf_xet`` moves a Xet-backed file's bytes outside the
hooked HTTP client, where no limit reaches them. ``huggingface_hub`` takes that path for a file whose
answer (HEAD) carries ``X-Xet-Hash`` or whose entry in the file listing carries ``xetHash``; a
download's answers lose both (:func:`_keep_off_xet`, :class:`RoutedTransport`), so the file comes over
HTTP, as it does for a client without ``hf_xet``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigError

logger = logging.getLogger("genkit.hubhttp")

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
    ``total``: the limit of a whole recipe load or model download (not worth another try).

    One that is not ``total`` (an answer's own limit) is also the HTTP library's ``ReadTimeout``
    (:func:`read_timeout`), so the Hub client tries the request again as it does after a read timeout."""

    def __init__(self, message: str, total: bool) -> None:
        super().__init__(message)
        self.total = total


def _http_library() -> Any:
    """The HTTP library the Hub client uses (``httpx2`` for huggingface_hub 2.x, else ``httpx``)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "httpx2", None) or getattr(_http, "httpx")  # noqa: B009 -- whichever it has


@functools.cache
def _error_classes() -> tuple[type[HubTimeout], type[HubTimeout]]:
    """The :class:`HubTimeout` that is also a read timeout, and the one that is also an HTTP error."""
    from huggingface_hub.errors import HfHubHTTPError

    class HubReadTimeout(HubTimeout, _http_library().ReadTimeout):  # type: ignore[misc]
        def __init__(self, message: str) -> None:
            _http_library().ReadTimeout.__init__(self, message)
            self.total = False

    class HubWaitRefused(HubTimeout, HfHubHTTPError):  # type: ignore[misc]
        def __init__(self, message: str, response: Any) -> None:
            HfHubHTTPError.__init__(self, message, response=response)
            self.request, self.total = response.request, True

    for cls in (HubReadTimeout, HubWaitRefused):  # errors name the class users know (genkit.hubhttp.HubTimeout)
        cls.__name__ = cls.__qualname__ = HubTimeout.__name__
    return HubReadTimeout, HubWaitRefused


def read_timeout(message: str) -> HubTimeout:
    """An answer that did not arrive within its own limit: a :class:`HubTimeout` (not ``total``) that
    is also the HTTP library's ``ReadTimeout``, which the Hub client tries again (as genkit's recipe
    loader does)."""
    return _error_classes()[0](message)  # type: ignore[call-arg]


def hub_timeout_of(exc: BaseException | None) -> HubTimeout | None:
    """The :class:`HubTimeout` ``exc`` is, or was raised from (the Hub client reports a request that
    failed in an error of its own, e.g. ``LocalEntryNotFoundError``); None when there is none."""
    for _ in range(20):  # a chain of causes is short; never follow a cycle for ever
        if exc is None or isinstance(exc, HubTimeout):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


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
    fails with the :class:`HubTimeout` this raises from the trace (a :func:`read_timeout` when it is
    the request's own limit)."""

    def __init__(self, url: str, per_request: float, deadline: Deadline | None, headers_only: bool,
                 method: str = "GET") -> None:
        self.url, self.per_request, self.deadline, self.headers_only = url, per_request, deadline, headers_only
        self.method = method
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
            self.error = HubTimeout(self.message(total), True) if total else read_timeout(self.message(total))
        self._shutdown()

    def message(self, total: bool) -> str:
        path = urlsplit(self.url).path
        if total and self.deadline is not None:
            return (f"{self.method} {path} stopped: {self.deadline.what} did not finish within "
                    f"{self.deadline.seconds:g} s ({self.deadline.setting})")
        part = "sent no complete answer headers" if self.headers_only else "did not finish"
        return f"{self.method} {path} {part} within {self.per_request:g} s ({DEADLINE_FACTOR} x GENKIT_HUB_TIMEOUT)"

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


#: the request header that names the download a request belongs to; taken off before it is sent
DOWNLOAD_HEADER = "X-Genkit-Download"
#: answers the Hub client tries again after a pause (huggingface_hub's ``_DEFAULT_RETRY_ON_STATUS_CODES``)
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

#: the answer headers that send huggingface_hub down the Xet path (with hf_xet installed)
XET_HEADERS = ("X-Xet-Hash", "X-Xet-Refresh-Route")
_TREE_LISTING = re.compile(r"/api/(?:models|datasets|spaces)/[^/]+/[^/]+/tree/")


class ProxyRoutes:
    """The proxies of one download, in transformers' (requests') format: ``{"http": "host:3128",
    "https://hostname": "host:4012", "all": ...}``. A request goes through the proxy of the first of
    ``scheme://host``, ``scheme``, ``all://host``, ``all`` that is given, else the Hub client's way."""

    def __init__(self, proxies: Mapping[str, str]) -> None:
        self.proxies = {key: url if "://" in url else f"http://{url}" for key, url in proxies.items()}
        self.transports: dict[str, Any] = {}  # proxy URL -> its transport, made when first used
        self.lock = threading.Lock()

    def transport_for(self, url: str) -> Any | None:
        parts = urlsplit(url)
        scheme, host = parts.scheme, parts.hostname
        keys = [scheme, "all"] if host is None else [f"{scheme}://{host}", scheme, f"all://{host}", "all"]
        proxy = next((self.proxies[key] for key in keys if key in self.proxies), None)
        if proxy is None:
            return None
        with self.lock:
            if proxy not in self.transports:
                self.transports[proxy] = _http_library().HTTPTransport(proxy=proxy)
            return self.transports[proxy]

    def close(self) -> None:
        with self.lock:
            for transport in self.transports.values():
                transport.close()
            self.transports.clear()


@dataclass(frozen=True)
class Download:
    """One download under way: its total ``deadline``, each answer's headers' limit, its proxies."""

    deadline: Deadline
    per_request: float
    proxies: ProxyRoutes | None = None


_DOWNLOADS: dict[str, Download] = {}  # DOWNLOAD_HEADER's value -> the download
_CURRENT: ContextVar[Download | None] = ContextVar("genkit_download", default=None)
_INSTALL = threading.Lock()


class DownloadWatch(Watch):
    """The :class:`Watch` of one request of a download (:func:`download_deadline`)."""

    def __init__(self, url: str, download: Download, method: str) -> None:
        super().__init__(url, download.per_request, download.deadline, True, method=method)
        self.download = download


@contextmanager
def download_deadline(what: str, proxies: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Bound the requests of one download by ``huggingface_hub`` (``snapshot_download``,
    ``hf_hub_download``): each answer's headers within :data:`DEADLINE_FACTOR` x ``GENKIT_HUB_TIMEOUT``
    seconds (past it, a :func:`read_timeout`, which the Hub client tries again as after any read
    timeout), all of them, bodies and the client's pauses between tries included, within
    ``GENKIT_MODEL_DOWNLOAD_TIMEOUT`` seconds (past it, a :class:`HubTimeout` naming the request and
    the setting, tried no more; so is an answer whose ``Retry-After`` the rest of that time could not
    wait out). The library's own per-read timeouts (``HF_HUB_DOWNLOAD_TIMEOUT``,
    ``HF_HUB_ETAG_TIMEOUT``) still apply.

    Its requests go through ``proxies`` (:class:`ProxyRoutes`) when given, and keep off Xet storage,
    whose transfers no limit of genkit's reaches (see the module's docstring).

    Yields the headers to pass to the download function (``headers=``): they carry the limits to its
    worker threads. Requests made in this context are bounded without them; requests of other
    threads or downloads are not bounded by this one. A watched request gets a connection of its own
    (so its watch knows its socket); the others keep the client's pool."""
    deadline = Deadline(model_download_timeout(), "GENKIT_MODEL_DOWNLOAD_TIMEOUT", what)
    download = Download(deadline, DEADLINE_FACTOR * hub_timeout(), ProxyRoutes(proxies) if proxies else None)
    _install_hooks()
    token = secrets.token_hex(16)
    _DOWNLOADS[token] = download
    context = _CURRENT.set(download)
    try:
        yield {DOWNLOAD_HEADER: token}
    finally:
        _CURRENT.reset(context)
        del _DOWNLOADS[token]
        if download.proxies is not None:
            download.proxies.close()


def _install_hooks() -> None:
    """Give the HTTP clients of the Hub client's factory in use (proxies and certificates kept) the
    hooks :func:`_watch_download`, :func:`_refuse_long_waits` and :func:`_keep_off_xet`, and a
    :class:`RoutedTransport` in front of each of their transports. Done once: huggingface_hub keeps
    the client its factory made, and setting a factory drops that client, so it is done again only
    when another factory was set since."""
    import huggingface_hub

    with _INSTALL:
        made_by = client_factory()
        if getattr(made_by, "genkit_download_hooks", False):
            return

        def factory() -> Any:
            client = made_by()
            hooks = client.event_hooks
            client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _watch_download],
                                  "response": [*hooks.get("response", []), _refuse_long_waits, _keep_off_xet]}
            routed = _routed_transport_class()  # the client's transports (httpx keeps no public setter for them)
            client._transport = routed(client._transport)
            client._mounts = {pattern: None if transport is None else routed(transport)
                              for pattern, transport in client._mounts.items()}
            return client

        factory.genkit_download_hooks = True  # type: ignore[attr-defined]
        huggingface_hub.set_client_factory(factory)


def _watch_download(request: Any) -> None:
    """The request hook: a request of a download under way (its :data:`DOWNLOAD_HEADER`, else its
    context) gets a :class:`DownloadWatch`, which a redirect keeps, and a connection of its own."""
    token = request.headers.pop(DOWNLOAD_HEADER, None)
    download = _DOWNLOADS.get(token) if token is not None else _CURRENT.get()
    if download is None or isinstance(request.extensions.get("trace"), Watch):
        return
    if "/xet-read-token/" in request.url.path:  # the Xet path from a listing cached before, not by this download
        logger.warning("%s fetches a file through Xet storage (huggingface_hub took its Xet hash from a file listing "
                       "an earlier download left in the Hub cache): hf_xet moves its bytes, which %s does not bound; "
                       "set HF_HUB_DISABLE_XET=1 to download over HTTP within the limit",
                       download.deadline.what, download.deadline.setting)
    watch = DownloadWatch(str(request.url), download, request.method)
    request.extensions = {**request.extensions, "trace": watch}
    request.headers["Connection"] = "close"


def _refuse_long_waits(response: Any) -> None:
    """The response hook: an answer of a download's request that asks for a pause before another try
    (``Retry-After``; for a 429, a spent rate limit's reset) that would end past the download's
    limit fails at once: a :class:`HubTimeout` that is also the Hub client's ``HfHubHTTPError`` (so
    the client still falls back to a cached file where it does on an error answer)."""
    watch = response.request.extensions.get("trace")
    if not isinstance(watch, DownloadWatch) or watch.deadline is None or response.status_code not in RETRIED_STATUSES:
        return
    wait = server_wait(response)
    left = watch.deadline.left()
    if wait is None or wait[0] + 1 < left:  # the Hub client waits a second more than it is told
        return
    deadline = watch.deadline
    raise _error_classes()[1](  # type: ignore[call-arg]
        f"{watch.method} {urlsplit(watch.url).path} answered {response.status_code} with {wait[1]}, past the end "
        f"of {deadline.what} ({max(left, 0.0):.1f} s left of {deadline.seconds:g} s, {deadline.setting})", response)


def _keep_off_xet(response: Any) -> None:
    """The response hook: an answer to a download's request loses :data:`XET_HEADERS`, so huggingface_hub
    fetches the file over HTTP (bounded) instead of through hf_xet (out of reach of the limits)."""
    if isinstance(response.request.extensions.get("trace"), DownloadWatch):
        for name in XET_HEADERS:
            response.headers.pop(name, None)


@functools.cache
def _routed_transport_class() -> type:
    """:class:`RoutedTransport`, a transport of the Hub client's HTTP library."""
    library = _http_library()

    class RoutedTransport(library.BaseTransport):  # type: ignore[misc,name-defined]
        """In front of a transport of the Hub client's (``inner``): a download's requests go through
        its proxies (:class:`ProxyRoutes`) where they name one, and its file listings lose their
        entries' ``xetHash`` (:func:`_keep_off_xet`'s reason). Other requests are ``inner``'s alone."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def handle_request(self, request: Any) -> Any:
            watch = request.extensions.get("trace")
            if not isinstance(watch, DownloadWatch):
                return self.inner.handle_request(request)
            proxies = watch.download.proxies
            transport = (proxies.transport_for(str(request.url)) if proxies is not None else None) or self.inner
            response = transport.handle_request(request)
            if request.method != "GET" or response.status_code != 200 or not _TREE_LISTING.match(request.url.path):
                return response
            return _without_xet_hashes(library, request, response)

        def close(self) -> None:
            self.inner.close()

    return RoutedTransport


def _without_xet_hashes(library: Any, request: Any, response: Any) -> Any:
    """A file listing's answer without its entries' ``xetHash`` (the same answer when it is no listing)."""
    body = response.read()
    response.close()
    try:
        entries = json.loads(body)
    except ValueError:
        entries = None
    if isinstance(entries, list):
        body = json.dumps([{k: v for k, v in e.items() if k != "xetHash"} if isinstance(e, dict) else e
                           for e in entries]).encode()
    headers = [(k, v) for k, v in response.headers.multi_items()
               if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
    return library.Response(response.status_code, headers=headers, content=body, extensions=response.extensions,
                            request=request)


def server_wait(response: Any) -> tuple[float, str] | None:
    """The pause in seconds the server asks for before another try, as the Hub client reads it (for a
    429 with none of its rate limit left, the limit's reset; else ``Retry-After`` in whole seconds,
    the only form it reads), and how it asked; None when it asks for none."""
    from huggingface_hub import utils

    parse_limit = getattr(utils, "parse_ratelimit_headers", None)  # in the versions that read it
    limit = parse_limit(response.headers) if parse_limit is not None and response.status_code == 429 else None
    if limit is not None and limit.remaining == 0:
        return float(limit.reset_in_seconds), f"its rate limit spent for {limit.reset_in_seconds} s"
    value = response.headers.get("Retry-After", "").strip()
    return (float(value), f"Retry-After: {value} s") if value.isdigit() else None


__all__ = ["DEADLINE_FACTOR", "DOWNLOAD_HEADER", "RETRIED_STATUSES", "XET_HEADERS", "Deadline", "Download",
           "DownloadWatch", "HubTimeout", "ProxyRoutes", "Watch", "client_factory", "download_deadline", "hub_timeout",
           "hub_timeout_of", "model_download_timeout", "read_timeout", "seconds_setting", "server_wait"]
