"""``genkit serve``'s streamed text: the concatenated deltas are the non-streamed text of the same
request (seeded sampling on a tiny random Llama over a SentencePiece vocabulary with byte
fallback, so characters are split over byte tokens and some bytes are invalid UTF-8), with and
without ``logprobs``, and with a stop string that spans tokens; no delta carries a U+FFFD the
final text lacks. The server runs in this process (test_engine_gate's ``_serving``)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from test_engine_gate import _serving

import genkit
from genkit.models.tiny import tiny_llama

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from test_gguf_llama_tokenizer import write_tiny_llama_gguf

    from genkit.serve import build_app

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("sp") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    tok = genkit.load_tokenizer(path)
    app = build_app(tiny_llama(seed=0, vocab_size=len(tok)), tokenizer=tok, model_name="tiny",
                    chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    with _serving(app) as base:
        yield base


def _post(base: str, path: str, body: dict) -> object:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw)
    return [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_deltas_add_up_to_the_text(server, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for seed in (1, 2, 3):
        body = {"model": "tiny", "max_tokens": 30, "temperature": 1.0, "seed": seed,
                **({"messages": [{"role": "user", "content": "Hello \u65e5\u672c"}]} if chat else
                   {"prompt": "Hello \u65e5\u672c"})}
        text = _post(server, path, body)["choices"][0]
        text = text["message"]["content"] if chat else text["text"]
        assert len(text) > 10
        stops = [[], [text[len(text) // 2:len(text) // 2 + 3]]]
        for stop in stops:
            want = text[:text.find(stop[0])] if stop else text
            full = _post(server, path, {**body, "stop": stop})["choices"][0]
            assert (full["message"]["content"] if chat else full["text"]) == want
            for logprobs in ({}, {"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1}):
                events = _post(server, path, {**body, "stop": stop, "stream": True, **logprobs})
                deltas = [(c["delta"].get("content") or "") if chat else c["text"]
                          for e in events for c in e["choices"]]
                assert "".join(deltas) == want, (seed, stop, logprobs)
                assert "\ufffd" in want or not any("\ufffd" in d for d in deltas)
                finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
                assert finish == [full["finish_reason"]]
                if logprobs:
                    assert any(c["logprobs"] for e in events for c in e["choices"])
