"""Tool calls in ``genkit serve`` (issue 27, item 5) without a model: reading calls in the Hermes/Qwen
and Llama 3 conventions, the streamed deltas, and the prompt for templates with and without tools
support (the demo model's tokenizer, and the same with a template that takes ``tools``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("gguf")

from genkit.serve.limits import Limits  # noqa: E402
from genkit.serve.openai_api import APIError, chat_prompt  # noqa: E402
from genkit.serve.tools import ToolStream, parse_tool_calls, parse_tools  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_helpers import demo_folder  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_hermes_blocks_and_the_content_before_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_llama3_json_calls():
    content, calls = parse_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c["function"]["name"] for c in calls] == ["a", "b"]


def test_text_without_a_well_formed_call_is_content():
    for text in ("The weather is fine.", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                 '{"city": "Paris"}'):
        assert parse_tool_calls(text) == (text, [])


def test_streamed_auto_releases_text_until_a_call_may_begin():
    plan = parse_tools({"tools": [WEATHER]})
    stream = ToolStream(plan)
    pieces = ["Sure", ", one moment. <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "</tool_call>"]
    deltas = [d for p in pieces for d in stream.delta(p)]
    assert deltas == [{"content": "Sure"}, {"content": ", one moment. "}]
    chunks = stream.chunks(0, "", "stop")
    assert chunks[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    head, rest = chunks[0]["delta"]["tool_calls"][0], chunks[1]["delta"]["tool_calls"][0]
    assert head["function"]["name"] == "get_weather" and head["id"].startswith("call_")
    assert json.loads(head["function"]["arguments"] + rest["function"]["arguments"]) == {"city": "Paris"}

    words = ToolStream(plan)  # no call: everything is content, nothing held at the end
    got = [d["content"] for p in ("It is", " sunny <", "3") for d in words.delta(p)]
    got += [c["delta"]["content"] for c in words.chunks(0, "", "stop") if c["delta"]]
    assert "".join(got) == "It is sunny <3"


def test_tool_choice_checks_name_the_field():
    for body, param in (({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]}, "tools"),
                        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        with pytest.raises(APIError) as err:
            parse_tools(body)
        assert err.value.param == param
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    schema = required.generate_kwargs()["guided_json"]
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}


@pytest.fixture(scope="module")
def tokenizer():
    import genkit

    return genkit.load_tokenizer(demo_folder())


CONVERSATION = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]}


def test_template_without_tools_gets_the_hermes_system_prompt(tokenizer):
    text = tokenizer.decode(chat_prompt(CONVERSATION, tokenizer, Limits(), None, parse_tools(CONVERSATION)))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    none = tokenizer.decode(chat_prompt(CONVERSATION, tokenizer, Limits(), None,
                                         parse_tools({**CONVERSATION, "tool_choice": "none"})))
    assert "<tools>" not in none


def test_template_with_tools_gets_them_as_tools(tokenizer):
    template = ("{% for t in tools %}TOOL {{ t.function.name }}|{% endfor %}{% for m in messages %}"
                "[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
                "{{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}{% endif %}|{% endfor %}")
    text = tokenizer.decode(chat_prompt(CONVERSATION, tokenizer, Limits(), template, parse_tools(CONVERSATION)))
    assert text == "TOOL get_weather|[user]Weather in Paris?|[assistant]CALL get_weather Paris|[tool]sunny|"
