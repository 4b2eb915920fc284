"""Thin layer over the real ``huggingface_hub`` client: explicit endpoint, retries of transient
failures (5xx, 429, timeouts, dropped or truncated transfers) and errors that name the repo.

What the loader reads from the Hub (a revision, the file listing, the recipe files) is read by
:func:`bounded_get` through the client's HTTP session, never by the client's own helpers, which
have no timeout on the listing, follow any number of pages, read whole bodies of any size and
sleep for as long as a ``Retry-After`` header says: every answer here has ``GENKIT_HUB_TIMEOUT``
seconds per read and :data:`DEADLINE_FACTOR` times that in all (headers included), and a byte limit;
all the Hub traffic of one recipe load has ``GENKIT_RECIPE_FETCH_TIMEOUT`` seconds in all.

The HTTP library's timeouts are per read, so the wall-clock limits are :mod:`genkit.hubhttp`'s
(a :class:`~genkit.hubhttp.Watch` on each request)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from genkit.hubhttp import DEADLINE_FACTOR, Deadline, HubTimeout, Watch, client_factory

from .errors import RecipeFetchError, RecipeNotFoundError
from .settings import hub_endpoint, hub_retries, hub_timeout, recipe_fetch_timeout

logger = logging.getLogger("genkit.recipes")
T = TypeVar("T")


def api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub_endpoint())


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def not_found(exc: BaseException) -> bool:
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    return isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError))


def transient(exc: BaseException) -> bool:
    """Worth another try: server errors, rate limits, timeouts, dropped or truncated transfers."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if not_found(exc):
        return False
    if isinstance(exc, HfHubHTTPError):
        status = _status(exc)
        return status is None or status >= 500 or status == 429
    if isinstance(exc, (*_transport_errors(), LocalEntryNotFoundError, TimeoutError, ConnectionError)):
        return True
    return isinstance(exc, OSError) and "onsistency check" in str(exc)


def _library_errors(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes of these ``names`` that the installed HTTP libraries define
    (huggingface_hub 2.x uses ``httpx2``, 1.x ``httpx``; ``requests`` before that)."""
    out: list[type[BaseException]] = []
    for library in ("httpx2", "httpx", "requests"):
        try:
            module = __import__(library)
        except ImportError:
            continue
        for attr in names:
            cls = getattr(module, attr, None) or getattr(getattr(module, "exceptions", None), attr, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                out.append(cls)
    return tuple(out)


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's transport errors."""
    return _library_errors("TransportError", "ConnectionError", "Timeout")


#: bytes of one JSON answer (a revision, one page of a file listing) and of an error body that are read
MAX_JSON_BYTES = 16_000_000
MAX_ERROR_BYTES = 64_000


_TOTAL: ContextVar[Deadline | None] = ContextVar("genkit_hub_deadline", default=None)


@contextmanager
def recipe_deadline() -> Iterator[Deadline]:
    """The deadline of the recipe load under way in this context, or a new one of
    ``GENKIT_RECIPE_FETCH_TIMEOUT`` seconds for the block (every request and retry in it)."""
    current = _TOTAL.get()
    if current is not None:
        yield current
        return
    deadline = Deadline(recipe_fetch_timeout(), "GENKIT_RECIPE_FETCH_TIMEOUT", "the recipe's Hub requests")
    token = _TOTAL.set(deadline)
    try:
        yield deadline
    finally:
        _TOTAL.reset(token)


def bounded_get(url: str, limit: int, too_long: Callable[[], BaseException],
                params: dict[str, str] | None = None) -> tuple[bytes, Any]:
    """GET ``url`` with a client of the Hub client's (its factory: proxies, certificates) and its
    headers, on a connection of its own: at most ``GENKIT_HUB_TIMEOUT`` seconds per read and
    :data:`DEADLINE_FACTOR` times that for the whole answer, headers included (a :class:`HubTimeout`,
    which is retried), within the recipe load's deadline (:func:`recipe_deadline`; past it, a
    :class:`HubTimeout` that is not retried); the body read only up to ``limit`` bytes (then
    ``too_long()`` is raised). An error status raises the client's error (read from at most
    :data:`MAX_ERROR_BYTES` of its body). Returns the body and the response (for its headers)."""
    from huggingface_hub.utils import build_hf_headers

    timeout = hub_timeout()
    watch = Watch(url, DEADLINE_FACTOR * timeout, _TOTAL.get(), headers_only=False)
    try:
        with client_factory()() as client, client.stream(
                "GET", url, params=params, headers=build_hf_headers(), timeout=timeout, follow_redirects=True,
                extensions={"trace": watch}) as response:
            error = response.status_code >= 400
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > (MAX_ERROR_BYTES if error else limit):
                    if error:
                        break  # enough of an error body to say what went wrong
                    raise too_long()
                chunks.append(chunk)
            body = b"".join(chunks)
            if error:
                _raise_for_status(response, body)
    finally:
        watch.cancel()
    return body, response


def _raise_for_status(response: Any, body: bytes) -> None:
    """The Hub client's error for an error answer, built from its status, headers and the part of
    the body that was read (not the whole body, which may never end)."""
    from huggingface_hub.utils import hf_raise_for_status

    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")}
    hf_raise_for_status(type(response)(response.status_code, headers=headers, content=body,
                                       request=response.request))


def get_json(url: str, what: str, limit: int = MAX_JSON_BYTES) -> tuple[Any, Any, int]:
    """The parsed JSON answer of ``url`` (bounded as :func:`bounded_get`), the response and the
    body's length; an answer that is not JSON, or longer than ``limit`` bytes, is a
    :class:`RecipeFetchError` naming ``what``."""
    body, response = bounded_get(url, limit, lambda: RecipeFetchError(
        f"{what}: the Hub's answer is longer than {limit} bytes; not read further"))
    try:
        return json.loads(body), response, len(body)
    except (ValueError, RecursionError) as exc:
        raise RecipeFetchError(f"{what}: the Hub's answer is not JSON ({type(exc).__name__}: "
                               f"{str(exc)[:100]})") from exc


def _http_errors() -> tuple[type[BaseException], ...]:
    """Errors of the Hub client and its HTTP library that are not worth another try."""
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError, *_library_errors("HTTPError", "InvalidURL", "StreamError", "RequestException"))


def with_retries(what: str, repo_id: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; retry transient failures with backoff; raise RecipeFetchError / RecipeNotFoundError
    naming ``repo_id`` and the endpoint."""
    attempts = hub_retries()
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not_found(exc):
                raise RecipeNotFoundError(f"{what} {repo_id!r} on {hub_endpoint()}: {_short(exc)}") from exc
            if isinstance(exc, HubTimeout) and exc.total:
                raise RecipeFetchError(f"{what} {repo_id!r} from {hub_endpoint()}: {_short(exc)}") from exc
            if not transient(exc):
                if isinstance(exc, _http_errors()):  # a 4xx, too many redirects, a bad URL...
                    raise RecipeFetchError(f"{what} {repo_id!r} from {hub_endpoint()}: {_short(exc)}") from exc
                raise
            last = exc
            if attempt < attempts:
                delay = min(2.0, 0.2 * 2 ** (attempt - 1))
                logger.warning("%s %s failed (%s); retrying in %.1fs [%d/%d]", what, repo_id, _short(exc), delay,
                               attempt, attempts - 1)
                total = _TOTAL.get()
                time.sleep(delay if total is None else max(0.0, min(delay, total.left())))
    raise RecipeFetchError(
        f"{what} {repo_id!r} from {hub_endpoint()} failed after {attempts} attempts: {_short(last)}"
    ) from last


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]
