"""``genkit serve``'s admission control (genkit.serve.admission): ``--max-concurrent-requests`` requests
at once, running or waiting on either engine, the next one a 429 with ``Retry-After`` before it is
tokenized; every slot given back however its response ends (finished, a 400, the client gone before
or during a stream); ``/health``, ``/metrics`` and ``/v1/models`` answering while every slot is
taken; ``--request-timeout`` cancelling a request in its engine; ``--max-connections``. Before,
any client could queue unbounded work.

The server runs in this process on a tiny random Llama (test_engine_gate's). A test logits processor
(a plugin's field, ``hold_after``) holds the engine once a request has that many tokens, until the
test opens its gate: requests stay admitted for as long as a test needs, with no sleep."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from test_engine_gate import SPECIALS, _free_port, _raw_tokenizer, _serving

import genkit
from genkit.models.tiny import tiny_llama

PROMPT = [3, 4, 5, 6, 7]
LIMIT = 3
GATE = threading.Event()  # a held request waits for it (60 s at most)
TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"  # w<i> is token id i


def _hold(config: Any, ctx: Any) -> Any:
    after = getattr(config, "hold_after", None)
    if after is None:
        return None
    start = ctx.input_ids_seq_length

    def hold(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] - start >= after:
            GATE.wait(60)
        return scores
    return hold


class _HoldPlugin:
    @genkit.hookimpl
    def register_logits_processors(self, register):
        from genkit.plugins import FieldSpec

        register("hold_demo", _hold, order=10, fields=[FieldSpec("hold_after", None, lambda v: isinstance(v, int),
                                                                 "an int")])


@pytest.fixture(scope="module")
def held():
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.plugins import register_plugin, reset_registry

    reset_registry()
    register_plugin(_HoldPlugin(), name="hold-demo")
    yield
    GATE.set()
    reset_registry()


def _app(**settings):
    from genkit.serve import build_app
    from genkit.tokenizer import Tokenizer

    torch.set_num_threads(1)
    return build_app(tiny_llama(seed=0), tokenizer=Tokenizer(_raw_tokenizer(), SPECIALS), model_name="tiny",
                     chat_template=TEMPLATE, **settings)


@pytest.fixture(scope="module")
def server(held):
    GATE.set()
    with _serving(_app(max_concurrent_requests=LIMIT)) as base:
        yield base
    GATE.set()


@pytest.fixture(scope="module")
def timed(held):
    GATE.set()
    with _serving(_app(request_timeout=1.0)) as base:
        yield base
    GATE.set()


def _request(base: str, path: str, body: dict | None = None) -> tuple[int, Any, bytes]:
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _metrics(base: str) -> dict[str, float]:
    status, _, raw = _request(base, "/metrics")
    assert status == 200
    return {line.split()[0]: float(line.split()[1]) for line in raw.decode().splitlines() if not line.startswith("#")}


def _wait_for(base: str, test: Any, what: str) -> dict[str, float]:
    """The metrics once ``test(metrics)`` holds (polled, at most 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        m = _metrics(base)
        if test(m):
            return m
        assert time.monotonic() < deadline, f"{what}: {m}"
        time.sleep(0.02)


def _completion(**fields) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}


def _in_thread(results: list, base: str, body: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(_request(base, "/v1/completions", body)))
    thread.start()
    return thread


def test_the_request_past_the_limit_is_a_429_and_the_probes_answer(server):
    GATE.clear()
    results: list = []
    # two on continuous batching, one on the generate engine (a strategy by name): running or waiting, all count
    bodies = [_completion(hold_after=1), _completion(hold_after=1), _completion(hold_after=1, custom_generate="greedy")]
    threads = [_in_thread(results, server, body) for body in bodies]
    try:
        m = _wait_for(server, lambda m: m["genkit_requests_admitted"] == LIMIT, "three admitted")
        assert m["genkit_max_concurrent_requests"] == LIMIT and m["genkit_requests_refused"] == 0
        status, headers, raw = _request(server, "/v1/completions", _completion())
        assert status == 429 and headers["Retry-After"] == "1"
        assert json.loads(raw) == {"error": {
            "message": f"the server is at its limit of {LIMIT} concurrent requests (--max-concurrent-requests); "
                       "retry later", "type": "server_error", "param": None, "code": "server_overloaded"}}
        assert _request(server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "top_k": -5})[0] == 429
        assert _request(server, "/health")[:1] == (200,) and _request(server, "/v1/models")[0] == 200
        m = _metrics(server)
        assert m["genkit_requests_refused"] == 2 and m["genkit_requests_admitted"] == LIMIT
    finally:
        GATE.set()
        for t in threads:
            t.join(120)
    assert [r[0] for r in results] == [200] * LIMIT
    assert all(json.loads(r[2])["usage"]["completion_tokens"] == 4 for r in results)
    _wait_for(server, lambda m: m["genkit_requests_admitted"] == 0, "every slot back")
    assert _request(server, "/v1/completions", _completion())[0] == 200  # admitted again


def test_a_400_after_admission_gives_its_slot_back(server):
    GATE.set()
    for _ in range(LIMIT + 2):  # more than the slots: a leak would turn them into 429s
        status, _, raw = _request(server, "/v1/completions", _completion(top_k=-5))
        assert status == 400 and json.loads(raw)["error"]["param"] == "top_k"
    assert _metrics(server)["genkit_requests_admitted"] == 0


_LAYERS = ("this model has 2 layers, so premature layers are 0 (the word embeddings) to 1; 2 is the final layer DoLa "
           'contrasts them with. Accepted: "low", "high", or a non-empty list of those indices')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fields", "message"), [
    ({"dola_layers": [999]}, f"`dola_layers` names [999]: {_LAYERS}"),
    ({"dola_layers": [0, 2]}, f"`dola_layers` names [2]: {_LAYERS}"),
    ({"dola_layers": []}, f"`dola_layers` is empty: {_LAYERS}"),
    ({"assistant_early_exit": 2}, "`assistant_early_exit` must be a layer count from 1 to 1 (the model has 2 layers; "
                                  "the draft uses fewer than all of them); got 2"),
])
def test_a_setting_the_model_cannot_take_is_a_400_before_it_is_queued(server, fields, message, stream):
    """The strategies check these against the model when they run: the request was queued, then a
    stream answered 200 and an error event, a response a 400 naming no field. Now the strategy's own
    check runs before the request is queued (the engine never sees it)."""
    GATE.set()
    before = _metrics(server)
    status, headers, raw = _request(server, "/v1/completions", _completion(stream=stream, **fields))
    assert status == 400 and headers["Content-Type"] == "application/json"
    assert json.loads(raw) == {"error": {"message": message, "type": "invalid_request_error",
                                         "param": next(iter(fields)), "code": None}}
    m = _metrics(server)
    assert m["genkit_requests_total"] == before["genkit_requests_total"] and m["genkit_requests_admitted"] == 0
    ok = {k: [0, 1] if k == "dola_layers" else 1 for k in fields}  # what the model has runs
    status, _, raw = _request(server, "/v1/completions", _completion(**ok))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def _open_stream(base: str, body: dict) -> socket.socket:
    """A streaming chat request on a raw socket, read up to its first event (the role's chunk)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    assert seen.startswith(b"HTTP/1.1 200"), seen
    return sock


def test_clients_that_leave_mid_stream_or_before_it_leak_no_slot(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w3 w4 w5"}], "max_tokens": 50,
            "stream": True, "hold_after": 2}
    before = _metrics(server)
    for _ in range(4):  # rounds of LIMIT clients leaving while the engine is held: their slots come back at once
        GATE.clear()
        socks = [_open_stream(server, chat) for _ in range(LIMIT)]
        assert _metrics(server)["genkit_requests_admitted"] == LIMIT
        for s in socks:
            s.close()
        _wait_for(server, lambda m: m["genkit_requests_admitted"] == 0, "the slots of the clients that left")
        GATE.set()
    host, port = server.removeprefix("http://").split(":")
    data = json.dumps(_completion(max_tokens=50, stream=True, hold_after=0)).encode()
    GATE.clear()  # no token comes: the clients leave before the first event
    for k in range(2 * LIMIT):  # more than the slots: a leak would turn them into 429s
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        _wait_for(server, lambda m: m["genkit_requests_total"] == before["genkit_requests_total"] + 4 * LIMIT + k + 1
                  and m["genkit_requests_admitted"] == 0, "the request of a client that left, submitted then let go")
    GATE.set()
    m = _wait_for(server, lambda m: m["genkit_requests_admitted"] == 0 and m["genkit_requests_running"] == 0
                  and m["genkit_cache_free_blocks"] == m["genkit_cache_blocks"], "every request ended")
    assert m["genkit_requests_cancelled"] == before["genkit_requests_cancelled"] + 6 * LIMIT
    assert m["genkit_requests_refused"] == before["genkit_requests_refused"]  # none ever refused
    status, _, raw = _request(server, "/v1/completions", _completion())
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def _stream_events(base: str, body: dict) -> list[Any]:
    status, _, raw = _request(base, "/v1/completions", {**body, "stream": True})
    assert status == 200, raw
    lines = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("engine", [{}, {"custom_generate": "greedy"}], ids=["continuous", "generate"])
def test_a_request_past_the_timeout_is_stopped_and_its_compute_too(timed, engine):
    GATE.clear()
    before = _metrics(timed)
    try:
        t = time.monotonic()
        events = _stream_events(timed, _completion(max_tokens=100, hold_after=2, stream_options={
            "include_usage": True}, **engine))
        took = time.monotonic() - t
        assert 1.0 <= took < 30
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]] == [None, None, "length"]
        assert texts[2] == "" and events[-1]["usage"]["completion_tokens"] == 2
        status, _, raw = _request(timed, "/v1/completions", _completion(max_tokens=100, **engine))  # waits
        assert status == 504 and json.loads(raw)["error"] == {
            "message": "the request ran longer than this server's --request-timeout of 1 seconds and was stopped",
            "type": "server_error", "param": None, "code": "request_timeout"}
        m = _metrics(timed)
        assert m["genkit_requests_admitted"] == 0 and m["genkit_requests_timed_out"] == before[
            "genkit_requests_timed_out"] + 2
    finally:
        GATE.set()
    m = _wait_for(timed, lambda m: m["genkit_requests_running"] == 0 and m["genkit_requests_waiting"] == 0
                  and m["genkit_cache_free_blocks"] == m["genkit_cache_blocks"], "the engine let them go")
    assert m["genkit_requests_cancelled"] == before["genkit_requests_cancelled"] + 2
    # the held step computed one more token; nothing went on after it (200 tokens were asked for)
    assert m["genkit_generated_tokens_total"] - before["genkit_generated_tokens_total"] <= 2 + 1 + 1


def test_a_request_within_the_timeout_is_untouched(timed):
    GATE.set()
    status, _, raw = _request(timed, "/v1/completions", _completion(max_tokens=8))
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"
    assert json.loads(raw)["usage"]["completion_tokens"] == 8


def _get_keep_alive(host: str, port: int) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return sock, sock.recv(65536)


def test_max_connections_are_served_and_one_more_is_a_503(held):
    from genkit.serve.lifecycle import connection_limits

    with _serving(_app(max_concurrent_requests=2), **connection_limits(4, 2)) as base:
        host, port = base.removeprefix("http://").split(":")
        opened = [_get_keep_alive(host, int(port)) for _ in range(4)]  # open: kept alive 5 s
        assert all(answer.startswith(b"HTTP/1.1 200") for _, answer in opened)
        sock, answer = _get_keep_alive(host, int(port))
        while chunk := sock.recv(65536):  # uvicorn's answer, then it closes the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 503") and answer.endswith(b"\r\n\r\nService Unavailable")
        sock.close()
        for s, _ in opened:
            s.close()
        deadline = time.monotonic() + 30
        while _request(base, "/health")[0] != 200:  # the closed ones are counted out as the server sees them go
            assert time.monotonic() < deadline
            time.sleep(0.02)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sent before is skipped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    return True


def test_a_client_slow_to_send_its_head_or_body_is_let_go(held):
    """uvicorn never times out a connection that sends nothing, or its head a byte at a time: under
    --max-connections, a few hundred of them kept every other client out. A body that does not come
    is a 408 (``ServePolicy.body_timeout``); a request whose answer takes longer is not cut."""
    from genkit.serve.lifecycle import connection_limits
    from genkit.serve.security import ServePolicy

    app = _app(policy=ServePolicy(body_timeout=0.5))
    with _serving(app, **connection_limits(8, 2, head_timeout=0.5)) as base:
        host, port = base.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))
        head = socket.create_connection((host, int(port)))
        head.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())  # never ends
        assert _closed_within(idle, 30) and _closed_within(head, 30)
        body = socket.create_connection((host, int(port)))
        body.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{".encode())
        body.settimeout(30)
        answer = body.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert _closed_within(body, 30)
        GATE.clear()
        results: list = []
        thread = _in_thread(results, base, _completion(hold_after=1))
        try:
            _wait_for(base, lambda m: m["genkit_requests_admitted"] == 1, "the held request admitted")
            t = time.monotonic()
            while time.monotonic() < t + 1.0:  # twice the head timeout, while its answer is awaited
                assert _metrics(base)["genkit_requests_admitted"] == 1
                time.sleep(0.05)
        finally:
            GATE.set()
            thread.join(60)
        assert results[0][0] == 200 and json.loads(results[0][2])["usage"]["completion_tokens"] == 4


def _never_reading(base: str, body: dict) -> socket.socket:
    """A streaming chat request on a socket with a small receive buffer that is never read."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


# a large stream: 16 choices, each token's chunk with 20 alternatives (about 2 kB; 1.6 MB before the hold,
# where the client's buffer, the server's kernel buffer (4 kB here) and its transport's (64 kB) hold 100 kB)
_FLOOD = {"model": "tiny", "messages": [{"role": "user", "content": "w3 w4 w5"}], "max_tokens": 100, "n": 16,
          "temperature": 1.0, "logprobs": True, "top_logprobs": 20, "stream": True, "hold_after": 50}


@pytest.mark.parametrize("timeouts", [{"write_timeout": 0.5}, {"request_timeout": 1.0}], ids=["write", "request"])
def test_a_client_that_stops_reading_is_cut_and_its_slot_comes_back(held, timeouts):
    """A client that stopped reading a stream held its slot and its connection for good: the server's
    sends waited on a full buffer, under any --request-timeout. Now the connection is aborted once its
    client has not read for --write-timeout seconds, or once --request-timeout passes while a send
    waits (the write timeout 60 s then); the request is cancelled in its engine and its slot given back."""
    from genkit.serve.lifecycle import connection_limits

    app = _app(request_timeout=timeouts.get("request_timeout"))
    limits = connection_limits(8, 4, write_timeout=timeouts.get("write_timeout", 60.0))
    with _serving(app, send_buffer=4096, **limits) as base:
        GATE.clear()
        sock = _never_reading(base, _FLOOD)
        try:
            _wait_for(base, lambda m: m["genkit_requests_admitted"] == 1, "the request admitted")
            t = time.monotonic()
            m = _wait_for(base, lambda m: m["genkit_requests_admitted"] == 0,
                          "the slot of the client that stopped reading")
            assert time.monotonic() - t < 30
            assert m["genkit_requests_timed_out"] == (1 if "request_timeout" in timeouts else 0)
            sock.settimeout(30)
            seen = b""
            while chunk := sock.recv(1 << 20):  # what the server had written, then the connection closed
                seen += chunk
            assert seen.startswith(b"HTTP/1.1 200") and not seen.endswith(b"0\r\n\r\n") and b"[DONE]" not in seen
        finally:
            GATE.set()
            sock.close()
        m = _wait_for(base, lambda m: m["genkit_requests_running"] == 0
                      and m["genkit_cache_free_blocks"] == m["genkit_cache_blocks"], "the engine let it go")
        assert m["genkit_requests_cancelled"] == 1
        assert m["genkit_generated_tokens_total"] <= 16 * (50 + 1)  # stopped by the step held, of 100
        status, _, raw = _request(base, "/v1/completions", _completion())
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genkit", "serve", "no-such-model", "--port", str(_free_port()),
                           *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (("--max-concurrent-requests", "0"), "--max-concurrent-requests must be >= 1; got 0"),
    (("--max-connections", "0"), "--max-connections must be >= 1; got 0"),
    (("--max-connections", "100", "--max-concurrent-requests", "100"),
     "--max-connections (100) must be more than --max-concurrent-requests (100)"),
    (("--request-timeout", "0"), "--request-timeout must be a number of seconds > 0; got 0.0"),
    (("--request-timeout", "inf"), "--request-timeout must be a number of seconds > 0; got inf"),
    (("--write-timeout", "0"), "--write-timeout must be a number of seconds > 0; got 0.0"),
    (("--write-timeout", "nan"), "--write-timeout must be a number of seconds > 0; got nan"),
])
def test_the_options_are_checked_before_the_model_loads(args, message):
    r = _run_cli(*args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_concurrent_requests": 0}, "`max_concurrent_requests` must be an int >= 1; got 0"),
    ({"max_concurrent_requests": 2.5}, "`max_concurrent_requests` must be an int >= 1; got 2.5"),
    ({"request_timeout": -1}, "`request_timeout` must be a number of seconds > 0, or None; got -1"),
])
def test_build_app_checks_the_settings(held, settings, message):
    from genkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _app(**settings)


def test_the_cli_default_is_the_librarys():
    from genkit.cli import build_parser
    from genkit.serve.admission import DEFAULT_MAX_CONCURRENT_REQUESTS, default_max_connections
    from genkit.serve.lifecycle import DEFAULT_WRITE_TIMEOUT_SECONDS, connection_limits

    args = build_parser().parse_args(["serve"])
    assert args.max_concurrent_requests == DEFAULT_MAX_CONCURRENT_REQUESTS == 128
    assert args.max_connections is None and args.request_timeout is None
    assert args.write_timeout == DEFAULT_WRITE_TIMEOUT_SECONDS == 60.0
    assert connection_limits(None, 128)["limit_concurrency"] == default_max_connections(128) + 1 == 321
    assert connection_limits(None, 128)["http"].write_timeout == 60.0
    assert connection_limits(None, 128, write_timeout=2.5)["http"].write_timeout == 2.5
