"""genkit's apply_chat_template against transformers' on real chat templates as published
(tests/fixtures/chat_templates, their sources in index.json): the same text, the same token ids,
the same assistant masks, and an error where transformers raises one (a ConfigError carrying the
template's own message for ``raise_exception``), for each of a set of conversations: system + user,
multi-turn, tools as JSON schemas and as Python functions, tool calls and results, documents,
template kwargs, reasoning, a bad alternation; with and without ``add_generation_prompt`` and with
``continue_final_message``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genkit.errors import ConfigError, GenkitError
from genkit.tokenizer import tokenizer_from_folder

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
INDEX = json.loads((FIXTURES / "index.json").read_text())
TEMPLATES = {name: (FIXTURES / name).read_text(encoding="utf-8") for name in INDEX}
CONTROL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[INST]",
           "[/INST]", "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>", "<think>",
           "</think>", "<tool_call>", "</tool_call>"]


def get_weather(location: str, unit: str = "celsius"):
    """Get the current weather in a city.

    Args:
        location: The city, e.g. Paris
        unit: The unit (choices: ["celsius", "fahrenheit"])
    """


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city (°C)",
          "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The city"}},
                         "required": ["location"]}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CONVERSATIONS = {
    "system_user": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, caf\u00e9 \u65e5\u672c"}],
                    {}),
    "multi_turn": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "  Tell me a joke.  "}], {}),
    "assistant_last": ([{"role": "user", "content": "Count to three"}, {"role": "assistant", "content": "One, two,"}],
                       {}),
    "tools": ([ASK], {"tools": TOOLS}),
    "python_tools": ([ASK], {"tools": [get_weather]}),
    "tool_call_and_result": ([ASK, CALL, {"role": "tool", "name": "get_weather", "tool_call_id": "call_1",
                                          "content": "22 degrees"}], {"tools": TOOLS}),
    "documents": ([ASK], {"documents": [{"title": "Paris", "text": "Sunny, 22 degrees."},
                                        {"title": "Lyon", "text": "Rain."}]}),
    "template_kwargs": ([ASK], {"enable_thinking": False, "date_string": "01 Jan 2025", "citation_mode": "accurate",
                                "reasoning_effort": "high"}),
    "reasoning": ([ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."},
                   {"role": "user", "content": "Thanks"}], {}),
    "none_fields": ([{"role": "user", "content": "Hi", "name": None}], {}),
    "bad_alternation": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], {}),
}
MODES = [{"add_generation_prompt": True}, {"add_generation_prompt": False}, {"continue_final_message": True}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(genkit tokenizer, transformers PreTrainedTokenizerFast) of one folder: the tests' BPE
    tokenizer with the corpus' control tokens added as special tokens."""
    from conftest import write_bpe_tokenizer
    from tokenizers import Tokenizer as Backend

    path = write_bpe_tokenizer(tmp_path_factory.mktemp("corpus_tok"))
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens(CONTROL)
    backend.save(str(path / "tokenizer.json"))
    return tokenizer_from_folder(str(path)), transformers.PreTrainedTokenizerFast.from_pretrained(str(path))


def _outcome(tok, conversation, **kwargs):
    try:
        return "ok", tok.apply_chat_template(conversation, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared below
        return "error", exc


def _same(ours, ref):
    if ref[0] == "ok":
        assert ours[0] == "ok", f"genkit raised {ours[1]!r}; transformers rendered {ref[1]!r}"
        assert ours[1] == ref[1]
        return
    assert ours[0] == "error", f"transformers raised {ref[1]!r}; genkit gave {ours[1]!r}"
    assert isinstance(ours[1], GenkitError), ours[1]
    if isinstance(ref[1], jinja2.exceptions.TemplateError):  # the template's own message (raise_exception)
        assert isinstance(ours[1], ConfigError) and str(ref[1]) in str(ours[1])
    else:  # transformers' ValueError / TypeError on these inputs
        assert isinstance(ours[1], (ValueError, TypeError)), ours[1]


def test_the_corpus_is_indexed():
    assert sorted(p.name for p in FIXTURES.glob("*.jinja")) == sorted(INDEX) and len(INDEX) >= 15
    assert all(entry["source"] and entry["model"] for entry in INDEX.values())


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_genkit_renders_and_tokenizes_as_transformers(pair, name, conversation):
    ours, ref = pair
    messages, kwargs = CONVERSATIONS[conversation]
    for mode in MODES:
        for tokenize in (False, True):
            args = dict(chat_template=TEMPLATES[name], tokenize=tokenize, return_dict=False, **mode, **kwargs)
            _same(_outcome(ours, messages, **args), _outcome(ref, messages, **args))


def test_a_template_that_raises_gives_its_message(pair):
    ours, ref = pair
    messages = CONVERSATIONS["bad_alternation"][0]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Conversation roles must alternate"):
        ref.apply_chat_template(messages, chat_template=TEMPLATES["trl_gemma.jinja"], tokenize=False)
    with pytest.raises(ConfigError, match=r"cannot render this conversation \(TemplateError: Conversation roles "
                                          r"must alternate user/assistant/user/assistant/...\)"):
        ours.apply_chat_template(messages, chat_template=TEMPLATES["trl_gemma.jinja"], tokenize=False)


@pytest.mark.parametrize("name", ["trl_qwen3_training.jinja", "trl_lfm2_2_5.jinja"])
def test_generation_tags_give_the_assistant_mask_transformers_gives(pair, name):
    ours, ref = pair
    conversation = [{"role": "system", "content": "Be brief."}, ASK, {"role": "assistant", "content": "Sunny."},
                    {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Rain, 18 degrees."}]
    short = conversation[:3]
    for args in ({}, {"truncation": True, "max_length": 30}):
        want = ref.apply_chat_template(conversation, chat_template=TEMPLATES[name], return_assistant_tokens_mask=True,
                                       **args)
        got = ours.apply_chat_template(conversation, chat_template=TEMPLATES[name], return_assistant_tokens_mask=True,
                                       **args)
        assert got["input_ids"] == want["input_ids"] and got["assistant_masks"] == want["assistant_masks"]
        assert args or 0 < sum(got["assistant_masks"]) < len(got["input_ids"])
    want = ref.apply_chat_template([conversation, short], chat_template=TEMPLATES[name], padding=True,
                                   return_assistant_tokens_mask=True)
    got = ours.apply_chat_template([conversation, short], chat_template=TEMPLATES[name], padding=True,
                                   return_assistant_tokens_mask=True)
    assert got["input_ids"] == want["input_ids"] and got["assistant_masks"] == want["assistant_masks"]
    assert got["attention_mask"] == want["attention_mask"]


def test_a_batch_of_conversations_renders_as_transformers_does(pair):
    ours, ref = pair
    batch = [CONVERSATIONS["system_user"][0], CONVERSATIONS["multi_turn"][0]]
    template = TEMPLATES["trl_llama3_1.jinja"]
    assert ours.apply_chat_template(batch, chat_template=template, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(batch, chat_template=template, tokenize=False, add_generation_prompt=True)
    want = ref.apply_chat_template(batch, chat_template=template, padding=True, return_tensors="pt")
    got = ours.apply_chat_template(batch, chat_template=template, padding=True, return_tensors="pt")
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    assert got["attention_mask"].tolist() == want["attention_mask"].tolist()


def test_continue_final_message_with_a_field_name_and_its_errors(pair):
    ours, ref = pair
    messages = [ASK, {"role": "assistant", "content": "", "reasoning_content": "The user wants"}]
    template = TEMPLATES["trl_qwen3.jinja"]
    assert ours.apply_chat_template(messages, chat_template=template, tokenize=False,
                                    continue_final_message="reasoning_content") == \
        ref.apply_chat_template(messages, chat_template=template, tokenize=False,
                                continue_final_message="reasoning_content")
    with pytest.raises(ConfigError, match="`continue_final_message` and `add_generation_prompt` are not compatible"):
        ours.apply_chat_template(messages, chat_template=template, continue_final_message=True,
                                 add_generation_prompt=True)
    with pytest.raises(ConfigError, match='the final message has no "summary" to continue'):
        ours.apply_chat_template(messages, chat_template=template, continue_final_message="summary")
    with pytest.raises(ConfigError, match="`conversation` is empty"):
        ours.apply_chat_template([], chat_template=template)
    with pytest.raises(TypeError, match="add_special_tokens"):  # transformers: the keyword given twice
        ref.apply_chat_template(messages[:1], chat_template=template, tokenizer_kwargs={"add_special_tokens": True})
    with pytest.raises(ConfigError, match="`tokenizer_kwargs` cannot set `add_special_tokens`"):
        ours.apply_chat_template(messages[:1], chat_template=template, tokenizer_kwargs={"add_special_tokens": True})


def test_the_template_environment_keeps_its_budgets():
    from genkit import chat_template

    with pytest.raises(ConfigError, match="a JSON text of 9000000003 characters"):
        chat_template.render("{{ messages|tojson(indent=1000000000) }}", messages=[{"a": 1}])
    with pytest.raises(ConfigError, match="a formatted field of 1000000000 characters"):
        chat_template.render("{{ strftime_now('%1000000000Y') }}")
    with pytest.raises(ConfigError, match="underscore-prefixed attributes"):
        chat_template.render("{% set ns = namespace(__class__=1) %}")
    with pytest.raises(ConfigError, match="more than 1000000 loop iterations"):
        chat_template.render("{% generation %}{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}"
                             "{% endfor %}{% endgeneration %}")
    assert chat_template.render("{{ {'é': [1, 2]}|tojson(indent=2, sort_keys=True) }}|{{ 'é'|tojson }}|"
                                "{{ [1, 2]|tojson(separators=(',', ':')) }}") == '{\n  "é": [\n    1,\n    2\n  ]\n}|"é"|[1,2]'


def test_real_templates_make_a_few_times_their_text(monkeypatch):
    """what a render makes in all (chat_template.MAX_MADE) on a long conversation (400 messages,
    0.9 MB): within five times the rendered text for every template, so that MAX_MADE (four times
    MAX_CHARS) leaves real conversations room"""
    from genkit import chat_template

    para = ("The quick brown fox jumps over the lazy dog. " * 10 + "\n") * 5
    conversation = [{"role": "system", "content": "Be brief."}]
    conversation += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {para}"} for i in range(400)]
    conversation.append({"role": "user", "content": "last"})
    rendered = 0
    for name, template in sorted(TEMPLATES.items()):
        try:
            text, _ = chat_template.render_conversation(template, conversation, add_generation_prompt=True,
                                                        bos_token="<s>", eos_token="</s>")
        except ConfigError:  # gemma: no system role; llava: content parts; command-r: documents
            continue
        with monkeypatch.context() as m:
            m.setattr(chat_template, "MAX_MADE", 5 * len(text))
            assert chat_template.render_conversation(template, conversation, add_generation_prompt=True,
                                                     bos_token="<s>", eos_token="</s>")[0] == text, name
        rendered += 1
    assert rendered >= 20


def test_what_genkit_does_not_support_is_refused_by_name(pair):
    ours, _ = pair
    with pytest.raises(ConfigError, match="`sanitize_control_tokens=True` is not supported"):
        ours.apply_chat_template([ASK], chat_template=TEMPLATES["smollm2.jinja"], sanitize_control_tokens=True)
    with pytest.raises(ConfigError, match=r"`tools\[0\]` must be a JSON-schema dict or a Python function"):
        ours.apply_chat_template([ASK], chat_template=TEMPLATES["trl_qwen2_5.jinja"], tools=["get_weather"])
