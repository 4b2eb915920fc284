"""Every OpenAI field ``genkit serve`` accepts acts (issue 27, items 3 and 6), through the real
``openai`` client against the demo model in a subprocess: ``logit_bias``, ``presence_penalty``,
``frequency_penalty`` change the tokens exactly as ``generate()`` with the same setting on the
same model (the same processors), ``echo`` and ``best_of`` do what OpenAI documents, chat
``logprobs`` are typed as the spec says; and the surface vLLM users rely on: prompt lists,
``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version``, ``--chat-template``, the
positional model and ``GENKIT_API_KEY``. On main these fields were accepted and ignored, and the
routes did not exist."""

from __future__ import annotations

import http.client
import json

import pytest
import torch
from test_serve import demo_folder, launch  # noqa: F401 - the demo model's fixture

import genkit

openai = pytest.importorskip("openai")

KEY = "fields-key"
NAME = "smol"
# SmolLM2's turns without its default system prompt: a template of our own, so the test sees it used
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "The the the the"


@pytest.fixture(scope="module")
def served(demo_folder, tmp_path_factory):  # noqa: F811
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    proc, base = launch(demo_folder, "--served-model-name", NAME, "--chat-template", str(template),
                        env={"GENKIT_API_KEY": KEY})
    yield {"base": base, "proc": proc}
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(demo_folder):  # noqa: F811
    torch.set_num_threads(1)
    return genkit.load_model(demo_folder), genkit.load_tokenizer(demo_folder)


def _generate(reference, prompt_ids: list[int], n: int, **settings) -> list[int]:
    """generate()'s greedy tokens with ``settings``, up to the end-of-sequence token."""
    model, _ = reference
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, **settings)
    new = out[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    return new[:new.index(eos)] if eos in new else new


def _text(reference, ids: list[int]) -> str:
    return reference[1].decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(("openai_fields", "generate_settings"), [
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"frequency_penalty": 1.2}, {"frequency_penalty": 1.2}),
    ({"presence_penalty": 2.0, "frequency_penalty": -0.5}, {"presence_penalty": 2.0, "frequency_penalty": -0.5}),
])
def test_penalties_give_generates_tokens(client, reference, openai_fields, generate_settings):
    ids = reference[1].encode(PROMPT)
    plain = _generate(reference, ids, 16)
    want = _generate(reference, ids, 16, **generate_settings)
    assert want != plain  # the setting changes the output of this prompt
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, **openai_fields)
    assert r.choices[0].text == _text(reference, want)
    assert r.usage.completion_tokens == len(want) + (len(want) < 16)


def test_logit_bias_gives_generates_tokens_with_sequence_bias(client, reference):
    ids = reference[1].encode(PROMPT)
    plain = _generate(reference, ids, 12)
    bias = {str(plain[0]): -100, str(plain[1]): -30, "1000": 5.5}
    want = _generate(reference, ids, 12, sequence_bias={(int(k),): float(v) for k, v in bias.items()})
    assert want[0] != plain[0]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, logit_bias=bias)
    assert r.choices[0].text == _text(reference, want)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=12,
                                          temperature=0, logit_bias=bias)
    chat_ids = reference[1].apply_chat_template([{"role": "user", "content": PROMPT}], chat_template=TEMPLATE,
                                                add_generation_prompt=True, return_dict=False)
    chat_want = _generate(reference, chat_ids, 12, sequence_bias={(int(k),): float(v) for k, v in bias.items()})
    assert chat.choices[0].message.content == _text(reference, chat_want)


def test_penalty_processor_is_openais_formula():
    from genkit import PresenceFrequencyPenaltyLogitsProcessor

    ids = torch.tensor([[5, 7, 1, 1, 3], [5, 7, 2, 2, 2]])
    scores = torch.zeros(2, 8)
    out = PresenceFrequencyPenaltyLogitsProcessor(0.5, 0.25, prompt_length=2)(ids, scores)
    want = torch.zeros(2, 8)
    want[0, 1], want[0, 3] = -(0.5 + 2 * 0.25), -(0.5 + 0.25)  # the prompt's 5 and 7 are not counted
    want[1, 2] = -(0.5 + 3 * 0.25)
    assert torch.equal(out, want)


def test_echo_puts_the_prompt_before_the_completion(client, reference):
    prompt = "The capital of France is"
    want = _text(reference, _generate(reference, reference[1].encode(prompt), 8))
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == prompt + want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True))
    assert streamed == prompt + want


def test_best_of_returns_the_choice_with_the_highest_logprob_per_token(client):
    kw = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0, "seed": 11}
    all_three = client.completions.create(**kw, n=3, logprobs=0)  # the same three candidates (seeds 11, 12, 13)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in all_three.choices]
    ranked = sorted(range(3), key=lambda i: -means[i])
    assert len({c.text for c in all_three.choices}) > 1
    best = client.completions.create(**kw, best_of=3)
    assert [c.text for c in best.choices] == [all_three.choices[ranked[0]].text]
    assert best.usage.completion_tokens == all_three.usage.completion_tokens  # every candidate was generated
    two = client.completions.create(**kw, best_of=3, n=2)
    assert [c.text for c in two.choices] == [all_three.choices[i].text for i in ranked[:2]]
    assert [c.index for c in two.choices] == [0, 1]


def test_chat_logprobs_are_typed_as_the_spec(client, reference):
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 3
    for e in entries:
        assert isinstance(e.token, str) and isinstance(e.logprob, float) and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0,
                                          logprobs=False).choices[0].logprobs is None


def test_chat_uses_the_chat_template_flag_and_developer_is_system(client, reference):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    as_system = [{"role": "system", "content": "Be brief."}, messages[1]]
    ids = reference[1].apply_chat_template(as_system, chat_template=TEMPLATE, add_generation_prompt=True,
                                           return_dict=False)
    user_only = messages[1:]  # the model's own template adds its default system prompt here; --chat-template's not
    assert (reference[1].apply_chat_template(user_only, chat_template=TEMPLATE, add_generation_prompt=True,
                                             return_dict=False)
            != reference[1].apply_chat_template(user_only, add_generation_prompt=True, return_dict=False))
    want = _generate(reference, ids, 10)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == _text(reference, want)
    assert r.usage.prompt_tokens == len(ids)
    r = client.chat.completions.create(model=NAME, messages=user_only, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(reference[1].apply_chat_template(
        user_only, chat_template=TEMPLATE, add_generation_prompt=True, return_dict=False))


def test_a_list_of_prompts_gives_each_its_choices(client, reference):
    prompts = ["The capital of France is", "Water boils at"]
    wants = [_text(reference, _generate(reference, reference[1].encode(p), 6)) for p in prompts]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [wants[0], wants[0], wants[1], wants[1]]
    assert r.usage.prompt_tokens == sum(len(reference[1].encode(p)) for p in prompts)
    ids = [reference[1].encode(p) for p in prompts]
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in r.choices] == wants
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: wants[0], 1: wants[1]}


def _post(served, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    host, port = served["base"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST" if body is not None else "GET", path, body=json.dumps(body) if body is not None else None,
                 headers=headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_routes_models_tokenize_detokenize_version(served, client, reference):
    tok = reference[1]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    status, body = _post(served, "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    messages = [{"role": "user", "content": "Hi"}]
    status, body = _post(served, "/tokenize", {"model": NAME, "messages": messages})
    assert status == 200 and body["tokens"] == tok.apply_chat_template(messages, chat_template=TEMPLATE,
                                                                       add_generation_prompt=True, return_dict=False)
    status, body = _post(served, "/detokenize", {"tokens": tok.encode("Hello world")})
    assert status == 200 and body["prompt"] == tok.decode(tok.encode("Hello world"))
    status, body = _post(served, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = _post(served, "/version", None)
    assert status == 200 and body["version"] == genkit.__version__
    assert _post(served, "/tokenize", {"prompt": "x"}, key=None)[0] == 401  # GENKIT_API_KEY is the key


def test_the_api_key_from_the_environment_is_required(served):
    bad = openai.OpenAI(base_url=served["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
