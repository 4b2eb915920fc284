"""Multinomial sampling: seeded reproducibility, same draws as transformers under the same seed,
a statistical check that one step follows softmax(processed scores), and transition scores."""

from __future__ import annotations

import pytest
import torch
from tolerance import frequency_bound

import genkit

transformers = pytest.importorskip("transformers")
from transformers.generation import logits_process as T  # noqa: E402 (after the importorskip)

IDS = torch.tensor([[1, 10, 20, 30, 40]])
IDS3 = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
MASK3 = (IDS3 != 0).long()


def _sample(model, seed, **kw):
    torch.manual_seed(seed)
    return model.generate(IDS, do_sample=True, max_new_tokens=20, eos_token_id=None, **kw)


def test_same_seed_same_tokens_different_seed_different_tokens(tiny_model):
    a, b = _sample(tiny_model, 123, temperature=1.3), _sample(tiny_model, 123, temperature=1.3)
    assert torch.equal(a, b)
    others = [_sample(tiny_model, s, temperature=1.3) for s in (1, 2, 3)]
    assert all(not torch.equal(a, o) for o in others)


@pytest.mark.parametrize("kw", [
    {"temperature": 0.9},
    {"temperature": 0.7, "top_k": 8},
    {"top_p": 0.8, "top_k": 0, "repetition_penalty": 1.2},
    {"min_p": 0.1, "typical_p": 0.9},
])
def test_sampling_draws_identical_to_transformers_under_the_same_seed(tiny_pair, kw):
    hf, ours = tiny_pair
    torch.manual_seed(7)
    ref = hf.generate(IDS3, attention_mask=MASK3, do_sample=True, max_new_tokens=12, pad_token_id=0,
                      eos_token_id=None, **kw)
    torch.manual_seed(7)
    got = ours.generate(IDS3, attention_mask=MASK3, do_sample=True, max_new_tokens=12, eos_token_id=None, **kw)
    assert torch.equal(got, ref)


def _chi_square_critical(df: int) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    z = 3.090232  # N(0,1) upper 0.1%
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.mark.parametrize(("kw", "warpers"), [
    ({"temperature": 0.8, "top_k": 10}, lambda: [T.TemperatureLogitsWarper(0.8), T.TopKLogitsWarper(10)]),
    ({"temperature": 1.5, "top_k": 0, "top_p": 0.7}, lambda: [T.TemperatureLogitsWarper(1.5),
                                                              T.TopPLogitsWarper(0.7)]),
])
def test_first_sampled_token_follows_softmax_of_processed_scores(tiny_model, kw, warpers):
    draws = 20000
    # the real loop, one step, many draws: num_return_sequences expands the prompt
    torch.manual_seed(2024)
    out = tiny_model.generate(IDS, do_sample=True, max_new_tokens=1, num_return_sequences=draws, eos_token_id=None,
                              **kw)
    first = out[:, IDS.shape[1]]
    counts = torch.bincount(first, minlength=tiny_model.config.vocab_size).double()
    # expected: the model's logits processed by transformers' warpers, then softmax
    logits = tiny_model(IDS).logits[:, -1].float()
    scores = logits
    for w in warpers():
        scores = w(IDS, scores)
    probs = torch.softmax(scores, dim=-1)[0].double()
    assert counts[probs == 0].sum() == 0  # filtered tokens are never drawn
    keep = probs > 0
    assert int(keep.sum()) >= 3
    expected = probs[keep] * draws
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_critical(int(keep.sum()) - 1), chi2
    tv = 0.5 * float((counts / draws - probs).abs().sum())
    assert tv < frequency_bound(draws, int(keep.sum())) / 2, tv


def test_transition_scores_match_transformers_greedy_and_sampling(tiny_pair, tiny_model):
    hf, ours = tiny_pair
    eos = int(ours.generate(IDS3, attention_mask=MASK3, max_new_tokens=8, eos_token_id=None)[0, 7])
    for kw in ({}, {"do_sample": True, "temperature": 0.7, "top_k": 20}):
        torch.manual_seed(0)
        out = ours.generate(IDS3, attention_mask=MASK3, max_new_tokens=8, eos_token_id=eos, pad_token_id=0,
                            return_dict_in_generate=True, output_scores=True, output_logits=True, **kw)
        assert len(out.scores) == out.sequences.shape[1] - IDS3.shape[1]
        for scores in (out.scores, out.logits):
            for normalize in (False, True):
                got = genkit.compute_transition_scores(out.sequences, scores, normalize_logits=normalize)
                also = ours.compute_transition_scores(out.sequences, scores, normalize_logits=normalize)
                ref = hf.compute_transition_scores(out.sequences, scores, normalize_logits=normalize)
                torch.testing.assert_close(got, ref)
                torch.testing.assert_close(also, ref)
    # greedy: the transition score is the max processed score at each step
    out = ours.generate(IDS, max_new_tokens=6, eos_token_id=None, return_dict_in_generate=True, output_scores=True)
    ts = genkit.compute_transition_scores(out.sequences, out.scores)
    torch.testing.assert_close(ts[0], torch.stack([s[0].max() for s in out.scores]))


def test_compute_transition_scores_needs_scores(tiny_model):
    with pytest.raises(ValueError, match="output_scores"):
        genkit.compute_transition_scores(IDS, ())


def test_user_processor_runs_before_the_warpers_like_transformers(tiny_pair):
    """A user's extra processor is applied before top-k / temperature, as in transformers."""
    hf, ours = tiny_pair

    class Boost(genkit.LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = scores.clone()
            out[:, 77] += 50.0  # a token outside the model's top-5: kept only if applied before top_k
            return out

    ids = torch.tensor([[1, 10, 20, 30]])
    torch.manual_seed(0)
    ref = hf.generate(ids, do_sample=True, top_k=5, temperature=0.9, max_new_tokens=6, pad_token_id=0,
                      eos_token_id=None, logits_processor=transformers.LogitsProcessorList([Boost()]))
    torch.manual_seed(0)
    got = ours.generate(ids, do_sample=True, top_k=5, temperature=0.9, max_new_tokens=6, eos_token_id=None,
                        logits_processor=[Boost()])
    assert torch.equal(got, ref)
    assert (got[0, 4:] == 77).all()
