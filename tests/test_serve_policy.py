"""``genkit serve``'s security policy (:mod:`genkit.serve.security`) and its options, without a
server: which ``Host`` names it answers to, which origins and keys the options may name, and how
the API key a client sends is compared (through the :class:`~genkit.serve.security.Guard`
middleware, as uvicorn hands it the request's raw headers)."""

from __future__ import annotations

import pytest

from genkit.serve.security import ServePolicy


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])  # noqa: S104 - names, not a bind
def test_a_wildcard_bind_answers_to_localhost(bind):
    """``--host 0.0.0.0`` listens on loopback too (a container's published port is reached as
    ``localhost:8000``): ``Host: localhost`` was a 421, though a page cannot rebind ``localhost``."""
    every = ServePolicy(host=bind, port=8000)
    assert all(every.host_allowed(h) for h in ("localhost:8000", "LOCALHOST", "127.0.0.1:8000", "[::1]:8000"))
    assert not any(every.host_allowed(h) for h in ("evil.example:8000", "localhost.evil.example", "localhost:x"))
    lan = ServePolicy(host="192.168.1.5", port=8000)  # one address, not loopback: its own name only
    assert lan.host_allowed("192.168.1.5:8000") and not lan.host_allowed("localhost:8000")
