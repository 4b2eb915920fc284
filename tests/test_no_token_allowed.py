"""Constraints that leave a step no token, and strategy settings that contradict, are clear errors
before anything wrong is emitted.

* Every strategy refuses a step whose logits processors set every score of a row to ``-inf``
  (:class:`genkit.errors.NoTokenAllowedError`): before, greedy search emitted token 0 (a token the
  constraints ruled out, as transformers does), sampling failed in ``torch.multinomial`` with a bare
  RuntimeError, and ``genkit serve`` answered 500 or streamed ``NaN`` log-probabilities. A finished
  row (padded over) may have no token left without stopping the others.
* ``use_cache=False`` with contrastive search / drafting / early exit, ``num_return_sequences`` > 1
  with drafting, and ``guidance_scale`` with beams are refused with the config, so that ``genkit
  serve`` answers a 400 naming the field, not a 200 stream ending in an error event.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from test_engine_gate import PROMPT, WORDS, tokenizer  # noqa: F401
from test_serve_vllm_fields import base  # noqa: F401 - both engines serving this module's `model`

import genkit
from genkit.errors import GenerationError, NoTokenAllowedError, NotSupportedError
from genkit.generation.api import merge_config
from genkit.models.tiny import tiny_llama

VOCAB = 128
EVERY = list(range(VOCAB))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


def _generate(model, **kw):
    return genkit.generate(model, torch.tensor([PROMPT]), max_new_tokens=4, eos_token_id=None, **kw)


@pytest.mark.parametrize("kw", [
    {}, {"do_sample": True}, {"do_sample": True, "top_k": 5}, {"num_beams": 2},
    {"num_beams": 2, "do_sample": True}, {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0},
    {"num_beams": 2, "force_words_ids": [[5]]}, {"penalty_alpha": 0.5, "top_k": 3},
    {"prompt_lookup_num_tokens": 2}, {"prompt_lookup_num_tokens": 2, "do_sample": True},
    {"assistant_early_exit": 1}, {"dola_layers": "high"},
], ids=lambda kw: "-".join(kw) or "greedy")
def test_every_token_suppressed_is_refused_by_every_strategy(model, kw):
    with pytest.raises(NoTokenAllowedError, match="no token is allowed for row 0: the logits processors set every"):
        _generate(model, suppress_tokens=EVERY, **kw)


@pytest.mark.parametrize("do_sample", [False, True])
def test_assisted_decoding_refuses_it_too(model, do_sample):
    with pytest.raises(NoTokenAllowedError, match="no token is allowed"):
        _generate(model, suppress_tokens=EVERY, assistant_model=tiny_llama(seed=1), do_sample=do_sample)


class _RuleOutAfter:
    """Rules out every token of the rows that hold ``token`` (a logits processor)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        done = (input_ids[:, len(PROMPT):] == self.token).any(dim=1)
        return scores.masked_fill(done[:, None], float("-inf"))


def test_a_finished_row_may_have_no_token_left(model):
    """Two prompts, the first ends at its second greedy token: a processor that then rules out every
    token of that row changes nothing (the row is padded), as in generate without it."""
    prompts = torch.tensor([PROMPT, PROMPT[::-1]])
    plain = genkit.generate(model, prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    eos = int(plain[0, len(PROMPT) + 1])
    assert eos not in plain[1, len(PROMPT):len(PROMPT) + 2].tolist()  # the second row goes on past it
    want = genkit.generate(model, prompts, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = genkit.generate(model, prompts, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          logits_processor=[_RuleOutAfter(eos)])
    assert torch.equal(got, want)
    torch.manual_seed(0)
    sampled = genkit.generate(model, prompts, max_new_tokens=6, do_sample=True, eos_token_id=eos, pad_token_id=0,
                              logits_processor=[_RuleOutAfter(eos)])
    assert sampled.shape[0] == 2
    # while a row still runs, the same processor is an error
    with pytest.raises(NoTokenAllowedError, match="row 0"):
        genkit.generate(model, prompts, max_new_tokens=6, do_sample=False, eos_token_id=None,
                        logits_processor=[_RuleOutAfter(eos)])


def test_sampling_from_nan_scores_is_a_generation_error(model):
    """A draw from NaN scores is a GenerationError naming the row (was torch.multinomial's bare
    RuntimeError); greedy search takes the first NaN, as torch's argmax and the greedy fast paths do
    (tests/test_greedy_step.py)."""
    def nan(input_ids, scores):
        return torch.full_like(scores, float("nan"))

    with pytest.raises(GenerationError, match="the scores of row 0 are NaN"):
        _generate(model, logits_processor=[nan], do_sample=True)
    out = _generate(model, logits_processor=[nan], do_sample=False)
    assert out[0, len(PROMPT):].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("kw", [{"encoder_repetition_penalty": 1e308}, {"repetition_penalty": 1e-308},
                                {"guidance_scale": 1e308}])
def test_sampling_from_overflowed_scores_is_a_generation_error(model, kw):
    """(fuzzing generation_config.json) a penalty or scale that overflows a score to +inf made the
    softmax NaN: torch.multinomial's bare RuntimeError ("probability tensor contains either `inf`,
    `nan` or element < 0"). Greedy search takes the +inf token."""
    with pytest.raises(GenerationError, match=r"the scores of row 0 hold \+inf, so sampling has no distribution"):
        _generate(model, do_sample=True, **kw)
    assert _generate(model, do_sample=False, **kw).shape == (1, len(PROMPT) + 4)


def test_continuous_batching_fails_the_request(model):
    from genkit.continuous import generate_batch

    out = generate_batch(model, [PROMPT], max_new_tokens=4, eos_token_id=None, suppress_tokens=EVERY)["req_0"]
    assert out.status.name == "FAILED" and out.generated_tokens == []
    assert out.error.startswith("choosing the next token failed: no token is allowed for row 0")


@pytest.mark.parametrize(("kw", "error", "message"), [
    ({"use_cache": False, "penalty_alpha": 0.5, "top_k": 3}, ValueError,
     "`use_cache` must be True (or unset) with `penalty_alpha`: that strategy keeps entries in the model's cache"),
    ({"use_cache": False, "prompt_lookup_num_tokens": 2}, ValueError,
     "`use_cache` must be True (or unset) with `prompt_lookup_num_tokens`"),
    ({"use_cache": False, "assistant_early_exit": 1}, ValueError, "with `assistant_early_exit`: that strategy keeps"),
    ({"prompt_lookup_num_tokens": 2, "num_return_sequences": 2, "do_sample": True}, NotSupportedError,
     "`prompt_lookup_num_tokens` (assisted decoding) returns one sequence per prompt: `num_return_sequences` must be "
     "1; got 2"),
    ({"assistant_early_exit": 1, "num_return_sequences": 2, "do_sample": True}, NotSupportedError,
     "`assistant_early_exit` (assisted decoding) returns one sequence"),
    ({"guidance_scale": 1.5, "num_beams": 2}, NotSupportedError,
     "`guidance_scale` (classifier-free guidance) works with greedy search, sampling and assisted decoding; not "
     "with beam search: num_beams=2"),
])
def test_strategy_needs_are_checked_with_the_config(model, kw, error, message):
    with pytest.raises(error) as info:
        merge_config(model, None, dict(kw))
    assert message in str(info.value)
    with pytest.raises(error, match="use_cache|returns one sequence|not with beam search"):
        _generate(model, **kw)


# -- genkit serve ---------------------------------------------------------------------------------

def _post(base: str, body: dict) -> tuple[int, bytes]:  # noqa: F811
    req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                  "temperature": 0, **body}).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _strict(text: str):
    """JSON as a browser reads it: no NaN / Infinity."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


CONTRADICTION = {"allowed_token_ids": [40, 41], "bad_words": [WORDS[40], WORDS[41]], "logprobs": 3}


def test_serve_contradicting_constraints_are_a_400(base):  # noqa: F811
    status, raw = _post(base, CONTRADICTION)
    assert status == 400, raw
    error = _strict(raw.decode())["error"]
    assert error["type"] == "invalid_request_error"
    assert "no token is allowed" in error["message"]


def test_serve_contradicting_constraints_stream_an_error_event_in_valid_json(base):  # noqa: F811
    status, raw = _post(base, {**CONTRADICTION, "stream": True})
    assert status == 200
    events = [_strict(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert any("no token is allowed" in e.get("error", {}).get("message", "") for e in events), events


def test_serve_n_choices_of_a_one_row_strategy_run_one_after_another(base):  # noqa: F811
    """Prompt lookup drafts for one row: ``n`` = 2 runs it twice (it failed after answering 200:
    "assisted decoding supports batch size 1"); seeded, choice ``i`` is the one-choice request with
    seed ``seed + i``, as for every sampling request."""
    lookup = {"prompt_lookup_num_tokens": 2, "temperature": 1.0, "max_tokens": 6}
    status, raw = _post(base, {**lookup, "n": 2, "stream": True})
    assert status == 200
    events = [_strict(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert not [e for e in events if "error" in e], events
    assert {c["index"] for e in events for c in e["choices"] if c["text"]} == {0, 1}
    status, raw = _post(base, {**lookup, "n": 2, "seed": 7})
    assert status == 200, raw
    texts = [c["text"] for c in sorted(_strict(raw.decode())["choices"], key=lambda c: c["index"])]
    for i, text in enumerate(texts):
        status, raw = _post(base, {**lookup, "seed": 7 + i})
        assert status == 200 and _strict(raw.decode())["choices"][0]["text"] == text


@pytest.mark.parametrize(("body", "param"), [
    ({"use_cache": False, "penalty_alpha": 0.5, "top_k": 3}, "use_cache"),
    ({"guidance_scale": 1.5, "num_beams": 2, "n": 1}, "guidance_scale"),
])
def test_serve_refuses_strategy_contradictions_before_streaming(base, body, param):  # noqa: F811
    status, raw = _post(base, {**body, "stream": True})
    assert status == 400, raw
    error = _strict(raw.decode())["error"]
    assert error["param"] == param, error
