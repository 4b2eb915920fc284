"""Thin layer over the real ``huggingface_hub`` client: explicit endpoint, retries of transient
failures (5xx, 429, timeouts, dropped or truncated transfers) and errors that name the repo."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import RecipeFetchError, RecipeNotFoundError
from .settings import hub_endpoint, hub_retries

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


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's transport errors (huggingface_hub 2.x uses ``httpx2``, 1.x ``httpx``)."""
    out: list[type[BaseException]] = []
    for name in ("httpx2", "httpx", "requests"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        for attr in ("TransportError", "ConnectionError", "Timeout"):
            cls = getattr(module, attr, None) or getattr(getattr(module, "exceptions", None), attr, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                out.append(cls)
    return tuple(out)


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
            if not transient(exc):
                raise
            last = exc
            if attempt < attempts:
                delay = min(2.0, 0.2 * 2 ** (attempt - 1))
                logger.warning("%s %s failed (%s); retrying in %.1fs [%d/%d]", what, repo_id, _short(exc), delay,
                               attempt, attempts - 1)
                time.sleep(delay)
    raise RecipeFetchError(
        f"{what} {repo_id!r} from {hub_endpoint()} failed after {attempts} attempts: {_short(last)}"
    ) from last


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]
