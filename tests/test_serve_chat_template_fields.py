"""``genkit serve`` takes vLLM's chat-template fields: ``add_generation_prompt`` (default true),
``continue_final_message``, ``documents`` and ``chat_template_kwargs`` reach the model's template as
they reach it through transformers' ``apply_chat_template`` (the prompt ids compared with
transformers' on real templates, tests/fixtures/chat_templates); a request's own
``chat_template``, both flags true, kwargs the template does not read or that set what the server
sets, and documents for a template without them are a 400 naming the field. Before, each of these
fields was a 400 "unknown field".

The server runs in this process on a tiny random Llama and the corpus test's BPE tokenizer."""

from __future__ import annotations

import pytest
import torch
from serve_client import post_json
from test_chat_template_corpus import CONTROL, TEMPLATES, pair  # noqa: F401 - the tokenizers' fixture
from test_engine_gate import _serving

from genkit.models.tiny import tiny_llama

QWEN3, RAG = TEMPLATES["trl_qwen3.jinja"], TEMPLATES["vllm_command_r_rag_chat_template.jinja"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def servers(pair):  # noqa: F811
    pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    from contextlib import ExitStack

    from genkit.serve import build_app

    torch.set_num_threads(1)
    model = tiny_llama(seed=0, vocab_size=400 + len(CONTROL), max_position_embeddings=4096)  # RAG: 2244 tokens
    with ExitStack() as stack:
        yield {name: stack.enter_context(_serving(build_app(model, tokenizer=pair[0], model_name="tiny",
                                                            chat_template=template)))
               for name, template in (("qwen3", QWEN3), ("rag", RAG))}


def _tokenize(base: str, body: dict) -> tuple[int, dict]:
    return post_json(base, "/tokenize", body)


@pytest.mark.parametrize(("server", "fields", "messages", "reference"), [
    ("qwen3", {}, ASK, {"add_generation_prompt": True}),
    ("qwen3", {"add_generation_prompt": False}, ASK, {"add_generation_prompt": False}),
    ("qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, ASK,
     {"add_generation_prompt": True, "enable_thinking": False}),
    ("qwen3", {"add_generation_prompt": False, "continue_final_message": True},
     ASK + [{"role": "assistant", "content": "It is"}], {"continue_final_message": True}),
    ("rag", {"documents": [{"title": "Paris", "text": "Sunny."}], "chat_template_kwargs": {"citation_mode": "accurate"}},
     ASK, {"add_generation_prompt": True, "documents": [{"title": "Paris", "text": "Sunny."}],
           "citation_mode": "accurate"}),
])
def test_the_template_fields_render_as_transformers_renders_them(servers, pair, server, fields, messages,  # noqa: F811
                                                                  reference):
    template = QWEN3 if server == "qwen3" else RAG
    want = pair[1].apply_chat_template(messages, chat_template=template, return_dict=False, **reference)
    status, body = _tokenize(servers[server], {"messages": messages, **fields})
    assert status == 200 and body["tokens"] == want
    status, body = post_json(servers[server] + "/v1", "/chat/completions",
                             {"model": "tiny", "messages": messages, "max_tokens": 2, **fields})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(want)


@pytest.mark.parametrize(("server", "fields", "param", "message"), [
    ("qwen3", {"chat_template": "{{ messages }}"}, "chat_template", "`chat_template` in a request is not supported"),
    ("qwen3", {"continue_final_message": True}, "continue_final_message", "set `add_generation_prompt` to false"),
    ("qwen3", {"add_generation_prompt": "yes"}, "add_generation_prompt", "must be true or false"),
    ("qwen3", {"chat_template_kwargs": {"enable_thinkng": False}}, "chat_template_kwargs",
     "has `'enable_thinkng'`, which this model's chat template does not read"),
    ("qwen3", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "sets `add_generation_prompt`, which the server sets"),
    ("qwen3", {"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ("qwen3", {"documents": [{"text": "x"}]}, "documents", "does not render documents"),
    ("rag", {"documents": ["x"]}, "documents", "must be a list of objects"),
])
def test_template_fields_it_cannot_honour_are_refused_by_name(servers, server, fields, param, message):
    status, body = _tokenize(servers[server], {"messages": ASK, **fields})
    assert status == 400 and body["error"]["param"] == param and message in body["error"]["message"]
    status, body = post_json(servers[server] + "/v1", "/chat/completions", {"model": "tiny", "messages": ASK, **fields})
    assert status == 400 and body["error"]["param"] == param and message in body["error"]["message"]


def test_template_fields_on_completions_and_prompt_tokenize_are_chat_only(servers):
    status, body = post_json(servers["qwen3"] + "/v1", "/completions",
                             {"model": "tiny", "prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 400 and "`chat_template_kwargs` is not supported on completions (chat only)" in \
        body["error"]["message"]
    status, body = _tokenize(servers["qwen3"], {"prompt": "hi", "add_generation_prompt": True})
    assert status == 400 and body["error"]["param"] == "add_generation_prompt"
