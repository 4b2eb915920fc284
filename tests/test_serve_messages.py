"""``genkit serve``'s chat messages reach the chat template with their OpenAI fields, as
transformers' ``apply_chat_template`` and vLLM give them: a message's ``name``, an assistant's
``refusal``, a tool result's ``tool_call_id``; a key OpenAI's message of that role does not have
(or a content part's) is a 400 naming it. Before, every key but ``role`` and ``content`` was dropped
silently (``tool_call_id`` reached only templates that render tools).

The server runs in this process on a tiny random Llama and a word-level tokenizer (one word per
token id, test_engine_gate's), with a template that writes each field it receives as words;
``/tokenize`` returns the rendered prompt's ids."""

from __future__ import annotations

import pytest
import torch
from serve_client import post_json
from test_engine_gate import SPECIALS, _raw_tokenizer, _serving

from genkit.models.tiny import tiny_llama

# w<i> is token id i: the template's words show which fields it received (it renders `tools` itself,
# so tool messages reach it as they are: genkit.serve.tools)
TEMPLATE = ("{% if tools %}{% endif %}{% for m in messages %}{% if m.name %}{{ m.name }} {% endif %}{% if m.refusal %}{{ m.refusal }} "
            "{% endif %}{% if m.tool_call_id %}{{ m.tool_call_id }} {% endif %}{{ m.content }} {% endfor %}")


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from genkit.serve import build_app
    from genkit.tokenizer import Tokenizer

    torch.set_num_threads(1)
    app = build_app(tiny_llama(seed=0), tokenizer=Tokenizer(_raw_tokenizer(), SPECIALS), model_name="tiny",
                    chat_template=TEMPLATE)
    with _serving(app) as base:
        yield base


def _tokens(server, messages: list[dict]) -> list[int]:
    status, body = post_json(server, "/tokenize", {"messages": messages})
    assert status == 200, body
    return body["tokens"]


def test_name_reaches_the_template(server):
    assert _tokens(server, [{"role": "system", "name": "w3", "content": "w4"},
                            {"role": "user", "name": "w5", "content": "w6 w7"},
                            {"role": "assistant", "name": "w8", "content": "w9"}]) == [3, 4, 5, 6, 7, 8, 9]
    assert _tokens(server, [{"role": "user", "content": "w6 w7"}]) == [6, 7]  # no name: none rendered


def test_refusal_and_tool_call_id_reach_the_template(server):
    messages = [{"role": "user", "content": "w10"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "w11", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "w12", "name": "w16", "content": "w13"},
                {"role": "assistant", "refusal": "w14", "content": "w15"}]
    assert _tokens(server, messages) == [10, 16, 12, 13, 14, 15]  # the call itself has no content


def test_text_parts_reach_the_template_as_text(server):
    assert _tokens(server, [{"role": "user", "name": "w5", "content": [{"type": "text", "text": "w6 "},
                                                                      {"type": "text", "text": "w7"}]}]) == [5, 6, 7]


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "user", "content": "w3", "nickname": "w4"}],
     "`messages[0]` (role `user`) has fields this server does not take: 'nickname'; it takes role, content, name"),
    ([{"role": "user", "content": "w3", "tool_call_id": "w4"}],
     "`messages[0]` (role `user`) has fields this server does not take: 'tool_call_id'; it takes role, content, name"),
    ([{"role": "tool", "content": "w3", "refusal": "w4"}],
     "`messages[0]` (role `tool`) has fields this server does not take: 'refusal'; it takes role, content, name, "
     "tool_call_id"),
    ([{"role": "assistant", "content": "w3", "function_call": {"name": "f", "arguments": "{}"}}],
     "`messages[0]` (role `assistant`) has fields this server does not take: 'function_call'; it takes role, "
     "content, name, tool_calls, refusal"),
    ([{"role": "assistant", "content": "w3", "audio": {"id": "x"}}],
     "`messages[0]` (role `assistant`) has fields this server does not take: 'audio'; it takes role, content, name, "
     "tool_calls, refusal"),
    ([{"role": "user", "content": [{"type": "text", "text": "w3", "cache_control": {}}]}],
     "`messages[0].content` parts have fields a text part does not take: 'cache_control'; it takes type, text"),
    # an image (audio, file) part is refused naming it, not read as text or dropped
    ([{"role": "user", "content": [{"type": "text", "text": "w3"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "`messages[0].content[1]` is a part of type 'image_url': genkit serve reads text only (images, audio and files are not "
     "taken); content parts must be {\"type\": \"text\", \"text\": ...}"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "`messages[0].content[0]` is a part of type 'input_audio': genkit serve reads text only (images, audio and files are "
     "not taken); content parts must be {\"type\": \"text\", \"text\": ...}"),
    ([{"role": "user", "content": ["w3"]}],
     "`messages[0].content[0]` is not a text part: genkit serve reads text only (images, audio and files are not "
     "taken); content parts must be {\"type\": \"text\", \"text\": ...}"),
    ([{"role": "user", "content": "w3", "name": 5}], "`messages[0].name` must be a string; got 5"),
    ([{"role": "tool", "content": "w3", "tool_call_id": ["x"]}],
     "`messages[0].tool_call_id` must be a string; got ['x']"),
    # a role that is no string was a 500 (a list or an object looked up among the roles)
    ([{"role": ["user"], "content": "w3"}],
     "`messages[0].role` must be one of assistant, developer, system, tool, user; got ['user']"),
    ([{"role": "user", "content": "w3"}, {"role": {"name": "user"}, "content": "w4"}],
     "`messages[1].role` must be one of assistant, developer, system, tool, user; got {'name': 'user'}"),
])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_an_unknown_or_bad_message_field_is_a_400_naming_it(server, path, messages, message):
    extra = {"max_tokens": 2} if path != "/tokenize" else {}
    status, body = post_json(server, path, {"model": "tiny", "messages": messages, **extra})
    assert status == 400, body
    assert body["error"]["message"] == message
    assert body["error"]["param"] == "messages"


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("choice", [{"type": "function", "function": "f"}, {"type": "function", "function": None},
                                    {"type": "function", "function": ["f"]}, {"type": "function"},
                                    {"type": "function", "function": {"name": ["f"]}}])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_malformed_tool_choice_is_a_400_naming_it(server, path, choice):
    """A ``function`` that is not an object was a 500 (its ``name`` looked up on a string or None)."""
    extra = {"max_tokens": 2} if path != "/tokenize" else {}
    status, body = post_json(server, path, {"model": "tiny", "messages": [{"role": "user", "content": "w3"}],
                                            "tools": _TOOLS, "tool_choice": choice, **extra})
    assert status == 400, body
    assert body["error"] == {
        "message": '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                   f"one of ['f']}}}}; got {choice!r}", "type": "invalid_request_error", "param": "tool_choice",
        "code": None}
    status, body = post_json(server, "/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "w3"}],
                                                   "tools": _TOOLS, "tool_choice": {"type": "function",
                                                                                    "function": {"name": "f"}}})
    assert status == 200 and body["tokens"] == [3], body  # the well-formed choice
