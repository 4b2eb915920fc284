"""``genkit serve`` reads the one finish decision and the one sampler (issue 26): a seeded sampling
request gives ``generate()``'s tokens with and without ``logprobs`` (the request no longer changes
engine for them), its log-probabilities are those of the distribution the tokens were drawn from,
and ``max_time`` stops a request on the continuous engine as ``generate()`` stops it. The server
is test_serve's (a subprocess with the demo model, the real ``openai`` client)."""

from __future__ import annotations

import pytest
import torch
from test_serve import client, demo_folder, openai, reference, server  # noqa: F401 - the fixtures

PROMPT = "Once upon a time"


def _sampled(model_and_tokenizer, n: int, seed: int, **settings):
    model, tok = model_and_tokenizer
    ids = tok.encode(PROMPT)
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=True, temperature=1.0,
                         output_scores=True, return_dict_in_generate=True, **settings)
    new = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, new)]
    eos = model.generation_config.eos_token_id
    if eos in new:
        new, logprobs = new[:new.index(eos)], logprobs[:new.index(eos) + 1]
    return tok.decode(new, skip_special_tokens=True), logprobs


def test_a_seed_gives_generates_tokens_with_and_without_logprobs(client, reference):  # noqa: F811
    want, want_logprobs = _sampled(reference, 12, seed=7)
    kw = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 7}
    plain = client.completions.create(**kw)
    with_logprobs = client.completions.create(**kw, logprobs=2)
    assert plain.choices[0].text == want
    assert with_logprobs.choices[0].text == want
    got = with_logprobs.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert all(len(t) == 2 for t in got.top_logprobs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, logprobs=1, stream=True))
    assert streamed == want


def test_max_time_ends_a_request_after_one_token_as_generate_does(client, reference):  # noqa: F811
    model, tok = reference
    ids = tok.encode(PROMPT)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, max_time=1e-6)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert out.shape[1] == len(ids) + 1
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"max_time": 1e-6})
    assert r.choices[0].text == want and r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason == "length"  # a limit cut the text (genkit's reason: max_time)


def test_a_request_samples_by_one_rule_whatever_its_n(client, reference):  # noqa: F811
    """Without ``temperature``, a one-choice request's ``seed`` and ``top_p`` were accepted and ignored
    on this model, whose generation config does not sample (greedy), while ``n`` > 1 sampled: choice 0
    of ``n: 2, seed: 7`` was not what ``seed: 7`` alone gave. One rule now: a request samples when it
    sets ``n`` > 1 or a field that acts only when sampling (``seed``, ``top_p``, ...), at the model's
    temperature, else 1.0 (this model has none); ``temperature: 0`` is greedy."""
    model, tok = reference
    assert not model.generation_config.do_sample and model.generation_config.temperature in (None, 1.0)
    kw = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 12}
    one = client.completions.create(**kw, seed=7).choices[0].text
    two = [c.text for c in client.completions.create(**kw, seed=7, n=2).choices]
    assert two == [one, _sampled(reference, 12, seed=8)[0]] and one == _sampled(reference, 12, seed=7)[0]
    nucleus = [client.completions.create(**kw, top_p=0.9, seed=seed).choices[0].text for seed in (1, 2)]
    assert nucleus == [_sampled(reference, 12, seed=seed, top_p=0.9)[0] for seed in (1, 2)]
    assert nucleus[0] != nucleus[1]
    out = model.generate(torch.tensor([tok.encode(PROMPT)]), max_new_tokens=12, do_sample=False)
    greedy = client.completions.create(**kw, temperature=0, seed=7, top_p=0.9).choices[0].text
    assert greedy == tok.decode(out[0, len(tok.encode(PROMPT)):], skip_special_tokens=True) not in nucleus
    with pytest.raises(openai.BadRequestError) as e:  # a strategy that does not sample says why it was asked to
        client.completions.create(**kw, seed=7, extra_body={"penalty_alpha": 0.5, "top_k": 4})
    assert e.value.body == {"message": "`penalty_alpha` (contrastive search) is deterministic and single-beam: it needs "
                            "do_sample=False and num_beams=1; got do_sample=True, num_beams=1. (this request samples: "
                            "it sets `n` > 1 or a field that acts only when sampling, such as `seed` or `top_p`; send "
                            "`temperature: 0` to decode greedily)", "type": "invalid_request_error",
                            "param": "penalty_alpha", "code": None}
