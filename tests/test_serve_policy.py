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


@pytest.mark.parametrize(("option", "value", "words"), [
    ("--allowed-origins", "http://localhost:3000/", "no path, not even a trailing '/'"),
    ("--allowed-origins", "https://app.example/chat", "no path"),
    ("--allowed-origins", "app.example", "scheme://host[:port]"),
    ("--allowed-hosts", "api.internal:8000", "without a scheme, port or path"),
    ("--allowed-hosts", "https://api.internal", "without a scheme, port or path"),
])
def test_an_allowed_name_no_request_could_match_is_refused_at_start(capsys, option, value, words):
    """A browser's ``Origin`` never ends in ``/`` and a ``Host`` name is compared without its port:
    these entries were taken, and every request they were meant to let through was refused."""
    from genkit.cli import main

    assert main(["serve", "no-such-model", "--port", "8000", option, value]) == 2
    err = capsys.readouterr().err
    assert f"{option} takes" in err and words in err and repr(value) in err


def test_allowed_names_are_compared_as_requests_carry_them():
    policy = ServePolicy(allowed_origins=["HTTPS://App.Example", "http://[::1]:3000", "null"],
                         allowed_hosts=["API.internal", "[fd00::1]", "10.0.0.5"])
    assert policy.allowed_origins == ["https://app.example", "http://[::1]:3000", "null"]
    assert policy.origin_allowed("https://app.example", "127.0.0.1:8000")
    assert all(policy.host_allowed(h) for h in ("api.internal:8000", "[fd00::1]:8000", "10.0.0.5"))
