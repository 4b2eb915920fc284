"""Structured outputs and tools through ``genkit serve`` (issue 27, items 4 and 5): the real
``openai`` client against a server on 127.0.0.1 running the demo model. JSON is checked with
``jsonschema``; tool calls round-trip (assistant ``tool_calls`` -> ``tool`` message -> answer)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_client import post_json  # noqa: E402
from structured_helpers import demo_folder, running_server, schemas, tiny_bart_folder  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(demo_folder()) as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, **kw):
    return client.chat.completions.create(model="smollm2", temperature=0, **kw)


def test_response_format_json_schema_varied(client):
    for i, schema in enumerate(schemas(12, seed=1)):
        r = _chat(client, messages=[{"role": "user", "content": "Reply in JSON: " + json.dumps(schema)}],
                  max_tokens=96, response_format={"type": "json_schema",
                                                  "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"


def test_json_object_and_guided_fields(client):
    r = _chat(client, messages=[{"role": "user", "content": "A cat, as JSON."}], max_tokens=64,
              response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = _chat(client, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=8,
              extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model="smollm2", prompt="My phone number is", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = _chat(client, messages=[{"role": "user", "content": "Add two numbers."}], max_tokens=16,
              extra_body={"guided_grammar": 'start: NUM " + " NUM\nNUM: /[0-9]{1,2}/'})
    assert re.fullmatch(r"[0-9]{1,2} \+ [0-9]{1,2}", r.choices[0].message.content)
    # streamed, the pieces are the same JSON
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": WEATHER["function"]["parameters"]}}
    pieces = [c.choices[0].delta.content or "" for c in _chat(client, messages=ASK, max_tokens=48, stream=True,
                                                              response_format=fmt) if c.choices]
    whole = _chat(client, messages=ASK, max_tokens=48, response_format=fmt).choices[0].message.content
    assert "".join(pieces) == whole and json.loads(whole)["unit"] in ("celsius", "fahrenheit")


def test_structured_errors_name_the_field(client):
    cases = [({"response_format": {"type": "xml"}}, "response_format"),
             ({"extra_body": {"guided_regex": "([a-z"}}, "guided_regex"),
             ({"extra_body": {"guided_json": {"type": "object"}, "guided_choice": ["a"]}}, "guided_json"),
             # more choices than llguidance compiles (it panics somewhere past 30,000): a 400 on arrival
             ({"extra_body": {"guided_choice": [f"option {i}" for i in range(100_000)]}}, "guided_choice"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
             ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "tool_choice")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, messages=ASK, max_tokens=4, **kw)
        assert err.value.body["param"] == param, (kw, err.value.body)


def test_named_and_required_tool_choice_give_parseable_arguments(client):
    r = _chat(client, messages=ASK, max_tokens=48, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call, = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = _chat(client, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], max_tokens=80,
              tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    call, = r.choices[0].message.tool_calls
    spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    r = _chat(client, messages=ASK, max_tokens=12, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_streamed_tool_calls_assemble_to_the_same_call(client):
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kw = dict(messages=ASK, max_tokens=64, tools=[WEATHER], tool_choice=choice)
        whole = _chat(client, **kw).choices[0].message.tool_calls[0]
        calls: dict[int, dict] = {}
        finish = None
        for chunk in _chat(client, stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                    entry["id"] = d.id or entry["id"]
                    entry["name"] += (d.function.name or "") if d.function else ""
                    entry["arguments"] += (d.function.arguments or "") if d.function else ""
        assert finish == "tool_calls" and list(calls) == [0]
        assert calls[0]["name"] == whole.function.name and calls[0]["id"].startswith("call_")
        assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


def test_tool_call_round_trip(client):
    """auto: the model's call is parsed from its text, sent back with the tool's result, and the
    model answers; the prompt holds the call and the result in the Hermes convention."""
    first = _chat(client, messages=ASK, max_tokens=64, tools=[WEATHER],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = _chat(client, messages=messages, max_tokens=40, tools=[WEATHER])
    message = answer.choices[0].message
    assert message.content and message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and the result are in the prompt


def test_tokenize_renders_the_prompt_the_chat_completion_runs(server, client):
    """``/tokenize`` with ``tools`` gives the chat completion's prompt: as many tokens as its usage
    says, and those tokens sent as a plain completion give the same greedy text. On main
    ``tools`` was an unknown field of /tokenize."""
    status, body = post_json(server, "/tokenize", {"model": "smollm2", "messages": ASK, "tools": [WEATHER]})
    assert status == 200, body
    chat = _chat(client, messages=ASK, max_tokens=12, tools=[WEATHER])
    assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
    plain = client.completions.create(model="smollm2", prompt=body["tokens"], max_tokens=12, temperature=0)
    assert plain.choices[0].text == chat.choices[0].message.content
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    body = post_json(server, "/tokenize", {"messages": ASK, **kw})[1]
    assert body["count"] == _chat(client, messages=ASK, max_tokens=4, **kw).usage.prompt_tokens
    bare = post_json(server, "/tokenize", {"messages": ASK})[1]["tokens"]
    with_tools = post_json(server, "/tokenize", {"messages": ASK, "tools": [WEATHER]})[1]["tokens"]
    assert len(with_tools) > len(bare) + 40  # the tools are in the prompt
    assert post_json(server, "/tokenize", {"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})[1]["tokens"] == bare
    status, body = post_json(server, "/tokenize", {"prompt": "Hi", "tools": [WEATHER]})
    assert status == 400 and body["error"]["param"] == "tools"
    status, body = post_json(server, "/tokenize", {"messages": ASK, "tools": [{"type": "function"}]})
    assert status == 400 and body["error"]["param"] == "tools"


def test_streamed_tool_calls_carry_their_logprobs(client):
    """Streamed with ``logprobs``, the chunks of a tool-calling choice carry every token's entry
    once, in order: the same tokens and log-probabilities as the non-streamed answer, the tool-call
    deltas included (on main every tool chunk had ``logprobs: null``)."""
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required", "auto"):
        kw = dict(messages=ASK, max_tokens=40, tools=[WEATHER], tool_choice=choice, logprobs=True, top_logprobs=2)
        whole = _chat(client, **kw).choices[0]
        entries, tool_chunks_with_logprobs = [], 0
        for chunk in _chat(client, stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None:
                    entries += c.logprobs.content
                    tool_chunks_with_logprobs += bool(c.delta.tool_calls)
        want = whole.logprobs.content
        assert [e.token for e in entries] == [e.token for e in want], choice
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in want], abs=1e-4)
        assert [[t.token for t in e.top_logprobs] for e in entries] == [[t.token for t in e.top_logprobs] for e in want]
        if whole.message.tool_calls:
            assert tool_chunks_with_logprobs >= 1, choice


def test_an_encoder_decoder_models_completions_are_constrained(tmp_path):
    """``genkit serve`` of an encoder-decoder model (a tiny random BART through the transformers
    adapter): guided_choice, guided_regex and a JSON schema constrain each choice's text, sampled
    choices included, and each ends with ``stop``."""
    pytest.importorskip("transformers")
    tiny_bart_folder(tmp_path)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    runs = [({"guided_choice": ["yes", "no"]}, r"yes|no"),
            ({"guided_regex": "[A-Z]{3}-[0-9]{2}"}, r"[A-Z]{3}-[0-9]{2}"),
            ({"guided_choice": ["yes", "no"], "n": 3, "temperature": 1.0, "seed": 1}, r"yes|no"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, None)]
    with running_server(str(tmp_path)) as base:
        for extra, pattern in runs:
            status, body = post_json(base, "/v1/completions", {"model": "smollm2", "prompt": "hello there",
                                                                "max_tokens": 30, **extra})
            assert status == 200, body
            assert len(body["choices"]) == extra.get("n", 1)
            for choice in body["choices"]:
                text = choice["text"]
                assert choice["finish_reason"] == "stop", (extra, choice)
                if pattern is None:
                    jsonschema.validate(json.loads(text), schema)
                else:
                    assert re.fullmatch(pattern, text), (extra, text)
