"""Issue 26 "One spine", finish and sampling: every stop condition ``generate()`` honours stops a
request identically on continuous batching (the manager, ``generate_batch``,
``generate(cache_implementation="paged")``), each engine says why a row finished (the one finish
decision of ``genkit.strategy.finish``), and the same seed gives the same tokens whichever engine
runs a request (the one sampler of ``genkit.strategy.sampling``).

The reference is ``generate()`` on the same tiny random model."""

from __future__ import annotations

import pytest
import torch

from genkit.models.tiny import tiny_llama

PROMPT = [5, 17, 33, 8, 90]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1)


def _generate(model, prompt=PROMPT, **kw):
    out = model.generate(torch.tensor([prompt]), return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), out.finish_reasons[0]


def _manager(model, prompt=PROMPT, **kw):
    with model.init_continuous_batching() as manager:
        rid = manager.add_request(prompt, **kw)
        out = manager.get_result(rid, timeout=120)
    assert out is not None and out.error is None, out
    return out


def _every_engine(model, prompt=PROMPT, **kw):
    """(tokens, finish reason) from generate(), the manager and generate_batch, and the tokens of
    generate(cache_implementation="paged")."""
    want = _generate(model, prompt, **kw)
    by_manager = _manager(model, prompt, **kw)
    by_batch = model.generate_batch([prompt], **kw)["req_0"]
    paged = model.generate(torch.tensor([prompt]), cache_implementation="paged", **kw)[0, len(prompt):].tolist()
    return want, (by_manager.generated_tokens, by_manager.finish_reason), \
        (by_batch.generated_tokens, by_batch.finish_reason), paged


class StopAt:
    """A user's stopping criterion: a row is done once it holds ``token`` after the prompt."""

    def __init__(self, token: int, prompt_len: int) -> None:
        self.token, self.prompt_len = token, prompt_len

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_len:] == self.token).any(dim=-1)


def test_max_time_stops_after_one_token_on_every_engine(model):
    want, manager, batch, paged = _every_engine(model, max_new_tokens=12, eos_token_id=None, max_time=1e-6)
    assert len(want[0]) == 1 and want[1] == "max_time"
    assert manager == want and batch == want
    assert paged == want[0]


def test_a_custom_stopping_criterion_stops_every_engine_at_the_same_token(model):
    full, reason = _generate(model, max_new_tokens=12, eos_token_id=None)
    assert reason == "length" and len(full) == 12
    token = full[4]
    stop = full.index(token) + 1
    want, manager, batch, paged = _every_engine(model, max_new_tokens=12, eos_token_id=None,
                                                stopping_criteria=[StopAt(token, len(PROMPT))])
    assert want == (full[:stop], "criteria")
    assert manager == want and batch == want and paged == want[0]


def test_eos_lists_and_min_new_tokens(model):
    full, _ = _generate(model, max_new_tokens=12, eos_token_id=None)
    eos = [full[6], full[1]]  # a list; the second id comes first in the continuation
    want, manager, batch, paged = _every_engine(model, max_new_tokens=12, eos_token_id=eos)
    assert want == (full[:2], "eos")
    assert manager == want and batch == want and paged == want[0]
    # min_new_tokens holds the EOS ids back for 3 tokens: the tokens change, and every engine agrees
    want, manager, batch, paged = _every_engine(model, max_new_tokens=12, eos_token_id=eos, min_new_tokens=3)
    assert len(want[0]) >= 3 and not set(want[0][:3]) & set(eos)
    assert manager == want and batch == want and paged == want[0]


def test_finish_reasons_per_row_in_a_batch(model):
    full, _ = _generate(model, max_new_tokens=8, eos_token_id=None)
    other = [40, 41, 42, 43, 44]
    ids = torch.tensor([PROMPT, other])
    out = model.generate(ids, max_new_tokens=8, eos_token_id=full[2], return_dict_in_generate=True)
    row2 = out.sequences[1, len(other):].tolist()
    assert out.finish_reasons == ["eos", "eos" if full[2] in row2 else "length"]


def test_stop_strings_through_the_manager_give_generates_tokens(model):
    from test_batch import _raw_tokenizer

    from genkit.tokenizer import Tokenizer

    tok = Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    vocab = len(tok.get_vocab())
    prompt = tok("alpha bravo charlie")["input_ids"]
    full, _ = _generate(model, prompt, max_new_tokens=16, eos_token_id=None)
    # a stop string: a word the continuation generates after its first two tokens
    k = next(i for i in range(2, len(full)) if 3 <= full[i] < vocab and full[i] not in full[:i])
    stop = tok.decode([full[k]])
    kw = {"max_new_tokens": 16, "eos_token_id": None, "stop_strings": [stop], "tokenizer": tok}
    want = _generate(model, prompt, **kw)
    assert want[1] == "stop_string" and len(want[0]) <= k + 1
    by_manager = _manager(model, prompt, **kw)
    assert (by_manager.generated_tokens, by_manager.finish_reason) == want
    by_batch = model.generate_batch([prompt], **kw)["req_0"]
    assert (by_batch.generated_tokens, by_batch.finish_reason) == want


def test_length_and_cancelled_reasons_of_the_manager(model):
    out = _manager(model, max_new_tokens=5, eos_token_id=None)
    assert len(out.generated_tokens) == 5 and out.finish_reason == "length"
    with model.init_continuous_batching() as manager:
        rid = manager.add_request(PROMPT, max_new_tokens=400, eos_token_id=None, streaming=True)
        assert manager.get_result(rid, timeout=60) is not None  # it runs
        manager.cancel_request(rid)
        last = None
        for last in manager.request_id_iter(rid, timeout=30):
            pass
    assert last is not None and last.error == "cancelled" and last.finish_reason == "cancelled"


def test_seeded_sampling_gives_the_same_tokens_on_generate_and_the_manager(model):
    kw = {"do_sample": True, "top_k": 20, "temperature": 0.9, "max_new_tokens": 15, "eos_token_id": None}
    torch.manual_seed(7)
    want, _ = _generate(model, **kw)
    assert _manager(model, seed=7, **kw).generated_tokens == want
    with_logprobs = _manager(model, seed=7, top_logprobs=3, **kw)
    assert with_logprobs.generated_tokens == want
    # the log-probabilities are those of the distribution the tokens were drawn from
    torch.manual_seed(7)
    ref = model.generate(torch.tensor([PROMPT]), output_scores=True, return_dict_in_generate=True, **kw)
    lps = [torch.log_softmax(s[0].float(), -1) for s in ref.scores]
    assert with_logprobs.logprobs == pytest.approx([float(lp[t]) for lp, t in zip(lps, want)], abs=1e-5)
    for lp, top in zip(lps, with_logprobs.top_logprobs):
        best = lp.topk(3)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-5)


def test_the_sampler_draws_as_the_global_generator_does():
    from genkit.strategy import choose, choose_tokens

    scores = torch.randn(3, 50)
    torch.manual_seed(3)
    a = choose_tokens(scores, True)
    g = torch.Generator().manual_seed(3)
    b = choose(scores, True, g, logprobs=True, top=2)
    assert torch.equal(a, b.tokens)
    assert torch.allclose(b.logprobs, torch.log_softmax(scores, -1).gather(1, a[:, None]).squeeze(1))
    assert choose(scores, False).tokens.tolist() == scores.argmax(-1).tolist()
    with pytest.raises(ValueError, match="`top`"):
        choose(scores, False, top=-1)
