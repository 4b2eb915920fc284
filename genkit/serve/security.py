"""What ``genkit serve`` refuses before a route runs, as one ASGI middleware (:class:`Guard`).

In this order, each answered with OpenAI's error object:

0. a request that repeats a header these checks read (``Host``, ``Origin``, ``Authorization``,
   ``Content-Type``, ``Content-Length``) — 400 naming it (two copies could be read differently here
   and by the CORS middleware, which reads the first);
1. a ``Host`` header that is not the bound name (``localhost`` too on a loopback or wildcard address) nor in
   ``--allowed-hosts`` — 421 (DNS rebinding: a web page's own name pointing at 127.0.0.1);
2. a browser's cross-origin request (an ``Origin`` header other than the server's own) whose
   origin ``--allowed-origins`` does not list — 403 (Starlette's ``CORSMiddleware``, outside this
   one, answers the preflights and adds the CORS headers for the listed origins);
3. without the API key (``Authorization: Bearer KEY``, compared with :func:`hmac.compare_digest`)
   on every route but ``/health`` — 401;
4. a POST whose body is not ``application/json`` — 415 (a web page can send ``text/plain``, form
   and multipart bodies to any address without a CORS preflight);
5. a body over ``max_body_bytes`` — 400 (``param: "body"``), counted while it streams in: the
   body is never read whole past the limit; a body not whole ``body_timeout`` seconds after the
   request's head arrived (a client sending it a byte at a time) — 408. The body read is handed
   to the route, and the connection's later messages (the client's hang-up) pass through.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["Guard", "ServePolicy", "middleware"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers probe it)
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - names, not a bind


@dataclass
class ServePolicy:
    """The server's security settings (``genkit serve``'s flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: list[str] = field(default_factory=list)  # "*": any
    allowed_origins: list[str] = field(default_factory=list)  # "*": any
    max_body_bytes: int = 4 * 1024 * 1024
    body_timeout: float = 60.0  # seconds a body may take to arrive

    def __post_init__(self) -> None:
        """The listed names in the form requests carry them, or a :class:`ConfigError` naming the
        option: an entry that no request could ever match would otherwise be ignored in silence."""
        if self.api_key is not None and (not self.api_key.strip() or self.api_key != self.api_key.strip()
                                         or any(ord(c) < 32 or ord(c) == 127 for c in self.api_key)):
            raise ConfigError("--api-key must be a non-empty key without spaces at its start or end and without "
                              "control characters: a client could never send it in its `Authorization` header")
        self.allowed_hosts = [_listed_host(h) for h in self.allowed_hosts]
        self.allowed_origins = [_listed_origin(o) for o in self.allowed_origins]

    def host_allowed(self, header: str) -> bool:
        """Whether a ``Host`` header names this server: the bound name, ``localhost`` when bound
        to a loopback address or to every address (which includes loopback: ``--host 0.0.0.0``, a
        container's port reached as ``localhost:8000``), a listed name, or any IP literal when bound
        to every address. Neither ``localhost`` nor an IP literal can be a rebound DNS name: a page
        can rebind only a name it owns."""
        if "*" in self.allowed_hosts:
            return True
        name = _host_name(header)
        if name is None:
            return False
        names = {self.host.lower(), *(h.lower() for h in self.allowed_hosts)}
        if _is_loopback(self.host) or self.host in _WILDCARD_BINDS:
            names |= {"localhost", "127.0.0.1", "::1"}
        if name in names:
            return True
        return self.host in _WILDCARD_BINDS and _is_ip(name)

    def origin_allowed(self, origin: str, host_header: str) -> bool:
        """A browser's ``Origin``: the server's own (same origin) or one ``--allowed-origins`` lists."""
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return origin in (f"http://{host_header}", f"https://{host_header}")

    def key_matches(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        if not authorization or not authorization.lower().startswith("bearer "):
            return False
        # the header's bytes (Guard decodes them as latin-1) against the key's UTF-8 bytes, as curl
        # sends a key that is not ASCII
        return hmac.compare_digest(authorization[7:].strip().encode("latin-1"), self.api_key.encode())


def _host_name(header: str) -> str | None:
    """The name of a ``Host`` header (``name``, ``name:port``, ``[v6]``, ``[v6]:port``); ``None``
    for anything else (a port that is not a number, more after it)."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        end = header.find("]")
        name, port = (header[1:end], header[end + 1:]) if end > 0 else ("", "")
    elif header.count(":") == 1:
        name, colon, number = header.partition(":")
        port = colon + number
    else:
        name, port = header, ""
    digits = port[1:]  # RFC 3986: port = *DIGIT
    if not name or (port and not (port[0] == ":" and digits.isascii() and (digits.isdigit() or not digits))):
        return None
    return name


def _listed_host(entry: str) -> str:
    """An ``--allowed-hosts`` entry as :meth:`ServePolicy.host_allowed` compares it: a name or IP
    address without a port (a ``Host`` header's port is not compared), lower case; ``*``."""
    if entry == "*":
        return entry
    name = _host_name(entry)
    if name is not None and entry.strip().lower() in (name, f"[{name}]") and not set("/?#@") & set(name):
        return name
    raise ConfigError(f"--allowed-hosts takes host names or IP addresses without a scheme, port or path "
                      f"(api.example, 10.0.0.5), or '*'; got {entry!r}")


def _listed_origin(entry: str) -> str:
    """An ``--allowed-origins`` entry as a browser sends its ``Origin``: ``scheme://host[:port]``,
    lower case, no path (not even ``/``); ``*``; ``null``."""
    if entry in ("*", "null"):
        return entry
    scheme, sep, rest = entry.strip().lower().partition("://")
    if sep and scheme.isascii() and scheme.isalpha() and _host_name(rest) is not None and not set("/?#@") & set(rest):
        return f"{scheme}://{rest}"
    raise ConfigError(f"--allowed-origins takes browser origins scheme://host[:port], as a browser sends them: no "
                      f"path, not even a trailing '/' (https://app.example, http://localhost:3000), or '*'; "
                      f"got {entry!r}")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# headers a check reads: sent twice, this guard and Starlette's CORS middleware (which reads the first)
# could decide on different copies, so a request that repeats one is refused (RFC 9110 allows one of each)
_SINGLE_HEADERS = ("host", "origin", "authorization", "content-type", "content-length")


def _headers(scope: Scope) -> tuple[dict[str, str], str | None]:
    """The request's headers by lower-case name, and the first of :data:`_SINGLE_HEADERS` it repeats."""
    headers: dict[str, str] = {}
    repeated = None
    for k, v in scope.get("headers", []):
        name = k.decode("latin-1").lower()
        if name in headers and name in _SINGLE_HEADERS and repeated is None:
            repeated = name
        headers.setdefault(name, v.decode("latin-1"))
    return headers, repeated


async def _refuse(send: Send, status: int, message: str, type_: str, param: str | None = None,
                  code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The checks of the module docstring, in front of the app."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], policy: ServePolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers, repeated = _headers(scope)
        refusal = self._refusal(scope, headers, repeated)
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        if scope["method"] == "POST":
            body = await self._read_body(receive, headers, send)
            if body is None:
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str], repeated: str | None) -> tuple[Any, ...] | None:
        if repeated is not None:
            return (400, f"the request sends the `{repeated}` header more than once; send it once",
                    "invalid_request_error", repeated, "repeated_header")
        host = headers.get("host", "")
        if not self.policy.host_allowed(host):
            return (421, "this server does not answer to that Host header; the operator lists other names "
                         "with `genkit serve --allowed-hosts`", "invalid_request_error", "host", "misdirected_request")
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_allowed(origin, host):
            return (403, "cross-origin requests are refused; the operator allows origins with "
                         "`genkit serve --allowed-origins`", "permission_error", "origin", "origin_not_allowed")
        if scope["path"] not in _OPEN_PATHS and not self.policy.key_matches(headers.get("authorization")):
            return (401, "a valid API key is required: send `Authorization: Bearer KEY`", "authentication_error",
                    None, "invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                return (415, f"request bodies must be `application/json`; got {kind or 'none'!r}",
                        "invalid_request_error", "content-type", "unsupported_media_type")
        return None

    async def _read_body(self, receive: Receive, headers: dict[str, str], send: Send) -> bytes | None:
        """The body, read chunk by chunk up to the limit; ``None`` once a refusal is sent."""
        limit = self.policy.max_body_bytes
        too_big = (f"the request body is larger than this server's limit of {limit} bytes "
                   "(`genkit serve --max-body-size`)")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(send, 400, too_big, "invalid_request_error", "body", "request_too_large")
            return None
        chunks, size = [], 0
        deadline = time.monotonic() + self.policy.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await _refuse(send, 408, f"the request body did not arrive within {self.policy.body_timeout:g} "
                              "seconds", "invalid_request_error", "body", "request_timeout")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _refuse(send, 400, too_big, "invalid_request_error", "body", "request_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive channel that gives ``body`` once, then the connection's own messages (its hang-up)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def middleware(policy: ServePolicy) -> list[Any]:
    """Starlette's ``CORSMiddleware`` for ``--allowed-origins`` (preflights, response headers),
    then :class:`Guard`."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [Middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["authorization", "content-type"]),
            Middleware(Guard, policy=policy)]
