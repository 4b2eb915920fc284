"""``genkit serve``'s security policy (:mod:`genkit.serve.security`) and its options, without a
server: which ``Host`` names it answers to, which origins and keys the options may name, and how
the API key a client sends is compared (through the :class:`~genkit.serve.security.Guard`
middleware, as uvicorn hands it the request's raw headers)."""

from __future__ import annotations

import asyncio

import pytest

from genkit.errors import ConfigError
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


def _status(policy: ServePolicy, authorization: bytes) -> int:
    """The status :class:`Guard` answers a GET of ``/v1/models`` carrying ``authorization``, raw
    bytes as uvicorn hands them over."""
    from genkit.serve.security import Guard

    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models",
             "headers": [(b"host", b"127.0.0.1:8000"), (b"authorization", authorization)]}
    asyncio.run(Guard(app, policy)(scope, receive, send))
    return int(sent[0]["status"])


def test_a_key_that_is_not_ascii_matches_what_curl_sends():
    """The header's UTF-8 bytes were compared decoded as latin-1 and encoded again as UTF-8: a key
    such as ``clé`` never matched, and every request was a 401."""
    policy = ServePolicy(api_key="clé-ключ")
    assert _status(policy, "Bearer clé-ключ".encode()) == 200
    assert _status(policy, "Bearer cle-ключ".encode()) == 401
    assert _status(policy, b"Bearer cl\xe9-key") == 401  # latin-1 bytes are not the key's UTF-8 ones


@pytest.mark.parametrize("key", [" key", "key\n", "\t", "k\x00ey"])
def test_a_key_no_client_could_send_is_refused(key):
    with pytest.raises(ConfigError, match="--api-key must be a non-empty key without spaces"):
        ServePolicy(api_key=key)


def test_an_empty_api_key_variable_is_refused_not_served_without_a_key(monkeypatch, capsys):
    """``GENKIT_API_KEY=`` (a secret that did not reach the environment) served with no key at all."""
    from genkit.cli import main

    monkeypatch.setenv("GENKIT_API_KEY", "")
    assert main(["serve", "no-such-model", "--port", "8000"]) == 2
    assert "$GENKIT_API_KEY is set but empty" in capsys.readouterr().err
