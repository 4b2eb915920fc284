"""A prompt far over the context is refused before the tokenizer makes all its tokens: a 4 MiB
body (``--max-body-size``'s default) of ``"ab "`` was tokenized whole, 1.4 million tokens for a
512-token context, 64 s and ~780 MB of the tokenizer's memory per request (four at once: +3.1 GB),
before it was refused. Each request now reads the tokenizer's count window by window, and the
tokenizer is never handed more than a window of it; a prompt that fits is tokenized as before."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from conftest import write_bpe_tokenizer

import genkit
from genkit.serve.limits import Limits
from genkit.serve.openai_api import APIError, parse_request

CONTEXT = 512


class _Recording:
    """The real tokenizer, with the length of each text it was given to encode recorded."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def encode(self, text, **kwargs):
        self.encoded.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return genkit.load_tokenizer(str(write_bpe_tokenizer(tmp_path_factory.mktemp("tok"))))


def _parse(tokenizer, chat: bool, text: str, **fields):
    body = ({"model": "m", "messages": [{"role": "user", "content": text}]} if chat
            else {"model": "m", "prompt": text, "max_tokens": 1})
    return parse_request({**body, **fields}, chat=chat, tokenizer=tokenizer, model_name="m",
                         limits=Limits(max_model_len=CONTEXT), generation_fields=set())


@pytest.mark.parametrize(("chat", "param"), [(False, "prompt"), (True, "messages")])
def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized_whole(tokenizer, chat, param):
    text = "ab " * (4 * 1024 * 1024 // 3)
    recording = _Recording(tokenizer)
    with pytest.raises(APIError) as err:
        _parse(recording, chat, text)
    assert err.value.param == param and err.value.code == "context_length_exceeded"
    assert f"the prompt has more than {CONTEXT} tokens" in err.value.message
    assert max(recording.encoded) <= 16384, "the tokenizer was handed the whole prompt"


@pytest.mark.parametrize("chat", [False, True])
def test_a_long_prompt_that_fits_gives_the_tokens_it_gave(tokenizer, chat):
    """Past 8 characters per context token the text is counted first; one that fits (a word the
    vocabulary holds whole, 11 characters a token) is tokenized whole, as it was."""
    text = " tokenizers" * (CONTEXT - 32)
    assert len(text) > 8 * CONTEXT
    parsed = _parse(tokenizer, chat, text)
    expected = (tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                              return_dict=False, add_generation_prompt=True) if chat
                else tokenizer.encode(text))
    assert parsed.prompts == [list(expected)] and len(parsed.prompts[0]) < CONTEXT


def test_truncate_prompt_tokens_still_takes_a_longer_prompt(tokenizer):
    text = "ab " * (9 * CONTEXT)
    parsed = _parse(tokenizer, False, text, truncate_prompt_tokens=100)
    assert parsed.prompts == [list(tokenizer.encode(text))[-100:]]


def test_tokenize_counts_chat_messages_over_the_context(tokenizer):
    """vLLM's ``/tokenize`` counts a prompt whatever its length (a client learns from it that the
    prompt is too long); only the completions refuse it."""
    from genkit.models.tiny import tiny_llama
    from genkit.serve.app import ServerState, _tokenize_body

    state = ServerState(tiny_llama(seed=0, vocab_size=400), tokenizer, None, "m", max_model_len=CONTEXT)
    text = "ab " * (9 * CONTEXT)
    body = {"messages": [{"role": "user", "content": text}]}
    expected = tokenizer.apply_chat_template(body["messages"], tokenize=True, return_dict=False,
                                             add_generation_prompt=True)
    assert _tokenize_body(body, state) == list(expected) and len(expected) > CONTEXT


class _Overlap:
    """The real tokenizer, with how many of its encodes and decodes ran at once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.now, self.most, self.lock = tokenizer, 0, 0, threading.Lock()

    def _counted(self, work, *args, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return work(*args, **kwargs)
        finally:
            with self.lock:
                self.now -= 1

    def encode(self, text, **kwargs):
        return self._counted(self.tokenizer.encode, text, **kwargs)

    def decode(self, ids, **kwargs):
        return self._counted(self.tokenizer.decode, ids, **kwargs)

    def __len__(self):
        return len(self.tokenizer)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_large_tokenize_and_detokenize_bodies_take_turns(tokenizer):
    """/tokenize and /detokenize take no admission slot: eight large bodies (4 MiB each could be) were tokenized at once (one
    worker thread each, 40 of them), each making the tokenizer's memory for all its tokens. Two at a
    time now."""
    from starlette.requests import Request

    from genkit.models.tiny import tiny_llama
    from genkit.serve.app import ServerState, _detokenize, _tokenize

    overlap = _Overlap(tokenizer)
    state = ServerState(tiny_llama(seed=0, vocab_size=400), overlap, None, "m", max_model_len=CONTEXT)
    ids = tokenizer.encode("hello world " * 8000, add_special_tokens=False)

    def request(path, body):
        raw = json.dumps(body).encode()

        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}
        return Request({"type": "http", "method": "POST", "path": path, "headers": []}, receive)

    async def main():
        calls = [_tokenize(request("/tokenize", {"prompt": "the quick brown fox " * 15000}), state) for _ in range(6)]
        calls += [_detokenize(request("/detokenize", {"tokens": ids}), state) for _ in range(2)]
        return await asyncio.gather(*calls)

    answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 8
    assert overlap.most <= 2, overlap.most
    assert json.loads(answers[-1].body)["prompt"] == tokenizer.decode(ids)
