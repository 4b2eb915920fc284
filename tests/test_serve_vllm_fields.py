"""vLLM's sampling fields on ``genkit serve``: ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``include_stop_str_in_output`` and ``skip_special_tokens`` act as in vLLM, on both engines
(continuous batching and generate), with the tokens ``generate`` gives for the generation
settings they stand for; a bad value is a 400 naming the field. Before, each was refused as an
unknown field, so a vLLM client (or vLLM's own serving benchmark, which sends ``ignore_eos``)
could not run against genkit serve.

A tiny random Llama whose end-of-sequence token is its third greedy token of the prompt, and a
word-level tokenizer whose text names each token (tests/test_engine_gate.py's)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from test_engine_gate import PROMPT, WORDS, _free_port, _raw_tokenizer, _serving, tokenizer  # noqa: F401

import genkit
from genkit.models.tiny import tiny_llama

MAX = 8


@pytest.fixture(scope="module")
def greedy() -> list[int]:
    """The tiny model's greedy tokens of PROMPT with no end-of-sequence token."""
    model = tiny_llama(seed=0)
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=MAX, do_sample=False, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def model(greedy):
    torch.set_num_threads(1)
    model = tiny_llama(seed=0)
    assert len(set(greedy[:4])) == 4 and 2 not in greedy  # the tokens below are told apart
    model.generation_config.eos_token_id = greedy[2]  # a greedy request ends at its third token
    return model


@pytest.fixture(scope="module", params=["ContinuousEngine", "GenerateEngine"])
def base(request, model, tokenizer):  # noqa: F811
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.serve import build_app
    from genkit.serve.engine import GenerateEngine

    engine = GenerateEngine(model, tokenizer) if request.param == "GenerateEngine" else None
    app = build_app(model, tokenizer=tokenizer, model_name="tiny", engine=engine)
    with _serving(app, engine=request.param) as url:
        yield url


def _post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": MAX,
                                                  "temperature": 0, **body}).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _choice(base: str, stream: bool = False, **body) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a one-choice request, streamed or not."""
    if not stream:
        status, out = _post(base, body)
        assert status == 200, out
        return out["choices"][0]["text"], out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": MAX,
                                                  "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}, **body}).encode())
    text, finish, used = "", None, -1
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                for c in event["choices"]:
                    text += c["text"]
                    finish = c["finish_reason"] or finish
                if event.get("usage"):
                    used = event["usage"]["completion_tokens"]
    return text, finish, used


def _generate(model, **settings) -> list[int]:
    """``generate``'s greedy new tokens with ``settings``, through the first EOS id."""
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=MAX, do_sample=False, **settings)
    new = out[0, len(PROMPT):].tolist()
    eos = settings.get("eos_token_id", model.generation_config.eos_token_id)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    cut = [i for i, t in enumerate(new) if t in eos]
    return new[:cut[0] + 1] if cut else new


def _words(ids: list[int]) -> str:
    return " ".join(WORDS[t] for t in ids if t > 2)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_ignore_eos_runs_to_max_tokens(base, model, greedy, stream):
    plain = _generate(model)
    assert plain == greedy[:3]  # the model's EOS id ends it, its word in the text (not a special token)
    assert _choice(base, stream) == (_words(plain), "stop", 3)
    assert _generate(model, eos_token_id=None) == greedy
    assert _choice(base, stream, ignore_eos=True) == (_words(greedy), "length", MAX)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_stop_token_ids_end_the_choice_at_their_token(base, model, greedy, stream):
    want = _generate(model, eos_token_id=[greedy[2], greedy[1]])
    assert want == greedy[:2]
    assert _choice(base, stream, stop_token_ids=[greedy[1]]) == (_words(want), "stop", 2)
    # with ignore_eos, only the stop tokens: past the model's EOS id to the fourth token
    assert _choice(base, stream, stop_token_ids=[greedy[3]], ignore_eos=True) == (_words(greedy[:4]), "stop", 4)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_min_tokens_holds_off_eos_ids_and_stop_strings(base, model, greedy, stream):
    want = _generate(model, min_new_tokens=5)
    assert len(want) >= 5 and want != greedy[:3]
    text, finish, used = _choice(base, stream, min_tokens=5)
    assert (text, used) == (_words(want), len(want))
    assert finish == ("stop" if len(want) < MAX else "length")
    # a stop string completed by the first token ends the text there ... unless min_tokens >= 1
    first = WORDS[greedy[0]]
    assert _choice(base, stream, stop=first, ignore_eos=True)[:2] == ("", "stop")
    rest = _words(greedy[1:])
    assert first not in rest  # so with min_tokens 1 nothing completes it again
    assert _choice(base, stream, stop=first, ignore_eos=True, min_tokens=1)[:2] == (_words(greedy), "length")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_include_stop_str_in_output_keeps_the_stop_string(base, greedy, stream):
    stop = WORDS[greedy[1]]
    before = _words(greedy[:1]) + " "
    assert stop not in before
    assert _choice(base, stream, stop=stop, ignore_eos=True)[:2] == (before, "stop")
    assert _choice(base, stream, stop=stop, ignore_eos=True, include_stop_str_in_output=True)[:2] == (
        before + stop, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_more_stop_strings_than_openais_four(base, greedy, stream):
    """vLLM takes any number of stop strings (lm-evaluation-harness's generation tasks send 5 and
    more); the server takes 32: the sixth ends the text as the first would."""
    stop = WORDS[greedy[1]]
    others = [w for w in ("w100", "w101", "w102", "w103", "w104") if w not in _words(greedy)]
    assert len(others) == 5
    assert _choice(base, stream, stop=[*others, stop], ignore_eos=True)[:2] == (_words(greedy[:1]) + " ", "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_skip_special_tokens_false_keeps_their_text(base, model, stream):
    """``</s>`` (id 2, a special token) forced first with ``logit_bias`` and made the EOS id with
    ``stop_token_ids``: its text is left out by default, kept with ``skip_special_tokens: false``."""
    forced = {"logit_bias": {"2": 100}, "stop_token_ids": [2]}
    assert _generate(model, eos_token_id=[model.generation_config.eos_token_id, 2], sequence_bias=[[[2], 100.0]]) == [2]
    assert _choice(base, stream, **forced) == ("", "stop", 1)
    assert _choice(base, stream, skip_special_tokens=False, **forced) == ("</s>", "stop", 1)


def test_top_k_minus_one_is_every_token_as_in_vllm(base):
    """vLLM's ``top_k: -1`` (every token; genkit's and transformers' 0) samples what ``top_k: 0``
    samples with the same seed; other negative values are refused, naming the field."""
    body = {"temperature": 1.0, "seed": 11, "ignore_eos": True}
    every = _choice(base, top_k=0, **body)
    assert _choice(base, top_k=-1, **body) == every
    assert _choice(base, top_k=2, **body) != every  # (the setting reaches the sampler)
    status, out = _post(base, {"top_k": -2, **body})
    assert (status, out["error"]["param"]) == (400, "top_k") and "`top_k` must be an int >= 0" in out["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_allowed_token_ids_keep_only_those_tokens(base, model, greedy, stream):
    """vLLM's ``allowed_token_ids``: every other token suppressed (``suppress_tokens``), so the
    tokens are generate's with the rest of the vocabulary suppressed, each one of the allowed."""
    allowed = [t for t in (40, 41, 42) if t != greedy[0]][:2]
    rest = [t for t in range(model.config.vocab_size) if t not in allowed]
    want = _generate(model, eos_token_id=None, suppress_tokens=rest)
    assert set(want) <= set(allowed) and want != greedy
    assert _choice(base, stream, allowed_token_ids=allowed, ignore_eos=True) == (_words(want), "length", MAX)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_bad_words_are_never_generated(base, model, greedy, stream):
    """vLLM's ``bad_words``: each word's tokens (``bad_words_ids``) never completed: the greedy first
    word banned, the tokens are generate's with it in ``bad_words_ids``."""
    want = _generate(model, eos_token_id=None, bad_words_ids=[[greedy[0]]])
    assert want[0] != greedy[0] and greedy[0] not in want
    assert _choice(base, stream, bad_words=[WORDS[greedy[0]]], ignore_eos=True) == (_words(want), "length", MAX)


def test_bad_words_tokenized_as_vllm_does(tokenizer):  # noqa: F811
    """A word is banned as written and, where its spaced form is a word of its own (a new first token,
    as many tokens), spaced: a word-level tokenizer gives one sequence; the request's own
    ``bad_words_ids`` are kept."""
    from genkit.serve.limits import Limits
    from genkit.serve.openai_api import parse_request

    parsed = parse_request({"model": "m", "prompt": "w3 w4", "bad_words": ["w7", " w9 w10"], "bad_words_ids": [[5, 6]]},
                           chat=False, tokenizer=tokenizer, model_name="m", limits=Limits(),
                           generation_fields={"bad_words_ids"})
    assert parsed.generate_kwargs["bad_words_ids"] == [[5, 6], [7], [9, 10]]


def test_truncate_prompt_tokens_keeps_the_prompts_end(base, model, greedy):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens are the prompt (-1: the model's
    context, which this one fits); an echoed prompt is the text of what the model read."""
    with torch.no_grad():
        out = genkit.generate(model, torch.tensor([PROMPT[-3:]]), max_new_tokens=MAX, do_sample=False,
                              eos_token_id=None)
    want = out[0, 3:].tolist()
    assert want != greedy
    status, body = _post(base, {"truncate_prompt_tokens": 3, "ignore_eos": True, "echo": True})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"] == _words(PROMPT[-3:]) + _words(want)
    status, body = _post(base, {"truncate_prompt_tokens": -1, "ignore_eos": True})
    assert (status, body["usage"]["prompt_tokens"]) == (200, len(PROMPT))
    assert body["choices"][0]["text"] == _words(greedy)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"allowed_token_ids": []}, "allowed_token_ids", "must be a non-empty list of token ids from 0 to 127"),
    ({"allowed_token_ids": [128]}, "allowed_token_ids", "got [128]"),
    ({"allowed_token_ids": "5"}, "allowed_token_ids", "must be a non-empty list"),
    ({"bad_words": [""]}, "bad_words", "`bad_words` must be a list of at most 256 non-blank strings"),
    ({"bad_words": "w5"}, "bad_words", "`bad_words` must be a list"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "`truncate_prompt_tokens` must be an integer >= 1"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens", "must be an integer"),
    ({"min_tokens": 9}, "min_tokens", "`min_tokens` must be <= `max_tokens` (8); got 9"),
    ({"min_tokens": -1}, "min_tokens", "`min_tokens` must be an integer >= 0"),
    ({"min_tokens": 2, "min_new_tokens": 2}, "min_tokens", "`min_tokens` is vLLM's name of `min_new_tokens`"),
    ({"ignore_eos": True, "eos_token_id": 5}, "ignore_eos", "`ignore_eos` and `eos_token_id` contradict"),
    ({"ignore_eos": "yes"}, "ignore_eos", "`ignore_eos` must be true or false"),
    ({"stop_token_ids": 5}, "stop_token_ids", "`stop_token_ids` must be a list of at most 256 token ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "`stop_token_ids` must be a list"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "`stop_token_ids` must be a list"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids", "at most 256 token ids"),
    ({"stop_token_ids": [500]}, "stop_token_ids", "500"),  # outside the 128-token vocabulary
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "must be true or false"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "must be true or false"),
])
def test_bad_values_are_a_400_naming_the_field(base, body, param, message):
    status, out = _post(base, body)
    assert status == 400, out
    assert out["error"]["param"] == param
    assert message in out["error"]["message"]
