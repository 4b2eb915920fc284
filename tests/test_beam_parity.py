"""Beam search parity with transformers 5.x on the same weights (``tiny_pair``).

Each configuration runs transformers' beam search and genkit's on the same prompt; sequences must
be identical, ``sequences_scores`` and ``beam_indices`` must agree, and ``compute_transition_scores``
must rebuild genkit's sequence scores. EOS ids are taken from a reference run (a token the model
actually produces) rather than written in by hand.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import logits_bound, score_bound, sum_bound

import genkit
from genkit.models.llama_infer import packing_available
from genkit.strategy.outputs import compute_transition_scores

PROMPT = torch.tensor([[1, 5, 9, 33, 70]])


def _run_both(pair, input_ids, attention_mask=None, **kw):
    hf, ours = pair
    common = dict(return_dict_in_generate=True, output_scores=True, do_sample=False, **kw)
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    ref = hf.generate(input_ids, **extra, **common)
    got = genkit.generate(ours, input_ids, **extra, **common)
    return ref, got


def _assert_same(ref, got, model, length_penalty=1.0, scale=1.0):
    """``scale``: how much the processors can multiply a log-prob's error (a repetition penalty)."""
    assert torch.equal(got.sequences, ref.sequences), (got.sequences, ref.sequences)
    atol = scale * score_bound(model, got.sequences, got.sequences_scores)
    torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, rtol=0, atol=atol)
    assert torch.equal(got.beam_indices.long(), ref.beam_indices.long())
    assert len(got.scores) == len(ref.scores)
    # the transition scores rebuild the sequence scores (generation docs recipe)
    trans = compute_transition_scores(got.sequences, got.scores, got.beam_indices)
    out_len = (got.beam_indices >= 0).sum(dim=1)
    rebuilt = trans.sum(dim=1) / out_len.float() ** length_penalty
    torch.testing.assert_close(rebuilt, got.sequences_scores, rtol=0, atol=sum_bound(trans.shape[1], rebuilt))


@pytest.fixture(scope="module")
def eos_ids(tiny_pair):
    """Token ids that beam search on PROMPT emits early (2nd and 4th new token of the best beam)."""
    hf, _ = tiny_pair
    with torch.no_grad():
        ref = hf.generate(PROMPT, num_beams=4, max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    new = ref[0, PROMPT.shape[1]:].tolist()
    return new[1], new[3]


CONFIGS = [
    {"num_beams": 2, "max_new_tokens": 8},
    {"num_beams": 3, "max_new_tokens": 10},
    {"num_beams": 4, "max_new_tokens": 12},
    {"num_beams": 5, "max_new_tokens": 9},
    {"num_beams": 6, "max_new_tokens": 7},
    {"num_beams": 4, "max_new_tokens": 12, "num_return_sequences": 4},
    {"num_beams": 5, "max_new_tokens": 10, "num_return_sequences": 2},
    {"num_beams": 3, "max_new_tokens": 12, "length_penalty": 0.0},
    {"num_beams": 4, "max_new_tokens": 12, "length_penalty": 2.0, "num_return_sequences": 3},
    {"num_beams": 4, "max_new_tokens": 12, "length_penalty": -1.0, "num_return_sequences": 2},
    {"num_beams": 4, "max_new_tokens": 10, "early_stopping": True},
    {"num_beams": 4, "max_new_tokens": 10, "early_stopping": "never", "length_penalty": 1.5},
    {"num_beams": 3, "max_new_tokens": 10, "early_stopping": "never", "length_penalty": -0.5},
    {"num_beams": 2, "max_length": 15},
    {"num_beams": 4, "max_new_tokens": 10, "repetition_penalty": 1.3},
    {"num_beams": 4, "max_new_tokens": 10, "no_repeat_ngram_size": 2, "num_return_sequences": 2},
    {"num_beams": 3, "max_new_tokens": 10, "use_cache": False},
]


@pytest.mark.parametrize("kw", CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CONFIGS])
def test_beam_search_matches_transformers(tiny_pair, kw):
    ref, got = _run_both(tiny_pair, PROMPT, eos_token_id=None, pad_token_id=0, **kw)
    _assert_same(ref, got, tiny_pair[1], kw.get("length_penalty", 1.0))


EOS_CONFIGS = [
    {"num_beams": 2, "max_new_tokens": 12},
    {"num_beams": 4, "max_new_tokens": 12, "num_return_sequences": 4},
    {"num_beams": 4, "max_new_tokens": 12, "early_stopping": True, "num_return_sequences": 2},
    {"num_beams": 4, "max_new_tokens": 12, "early_stopping": "never", "length_penalty": 2.0, "num_return_sequences": 3},
    {"num_beams": 5, "max_new_tokens": 12, "length_penalty": 0.0, "num_return_sequences": 5},
    {"num_beams": 3, "max_new_tokens": 12, "length_penalty": -2.0, "num_return_sequences": 3},
    {"num_beams": 6, "max_new_tokens": 10, "two_eos": True, "num_return_sequences": 6},
    {"num_beams": 3, "max_new_tokens": 12, "min_new_tokens": 4},
]


@pytest.mark.parametrize("kw", EOS_CONFIGS, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in EOS_CONFIGS])
def test_beam_search_with_eos_matches_transformers(tiny_pair, eos_ids, kw):
    kw = dict(kw)
    eos = list(eos_ids) if kw.pop("two_eos", False) else eos_ids[0]
    ref, got = _run_both(tiny_pair, PROMPT, eos_token_id=eos, pad_token_id=0, **kw)
    _assert_same(ref, got, tiny_pair[1], kw.get("length_penalty", 1.0))
    eos_list = eos if isinstance(eos, list) else [eos]
    if kw.get("length_penalty", 1.0) > 1.0 or "min_new_tokens" in kw or isinstance(eos, list):
        return  # length bonus / min length / 2nd EOS: the best hypotheses may rightly run to max_length
    # EOS was reached by at least one returned hypothesis (the configuration exercises finishing early)
    assert bool(torch.isin(got.sequences[:, PROMPT.shape[1]:], torch.tensor(eos_list)).any())


def test_left_padded_batch_matches_transformers(tiny_pair, eos_ids):
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12], [0, 1, 44, 45, 46, 47, 48]])
    mask = (ids != 0).long()
    for kw in ({"num_beams": 3, "max_new_tokens": 9, "num_return_sequences": 2},
               {"num_beams": 4, "max_new_tokens": 10, "eos_token_id": eos_ids[0], "num_return_sequences": 3,
                    "length_penalty": 0.7}):
        kw.setdefault("eos_token_id", None)
        ref, got = _run_both(tiny_pair, ids, attention_mask=mask, pad_token_id=0, **kw)
        _assert_same(ref, got, tiny_pair[1], kw.get("length_penalty", 1.0))


def test_logits_and_scores_outputs_match(tiny_pair):
    hf, ours = tiny_pair
    kw = {"num_beams": 3, "max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_scores": True,
              "output_logits": True, "eos_token_id": None, "pad_token_id": 0}
    ref = hf.generate(PROMPT, **kw)
    got = genkit.generate(ours, PROMPT, **kw)
    atol = logits_bound(ours, got.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    for a, b in zip(got.scores, ref.scores):  # log-probs plus the beam's score: 2 * atol per step
        finite = torch.isfinite(b)
        assert torch.equal(finite, torch.isfinite(a))
        torch.testing.assert_close(a[finite], b[finite], rtol=0, atol=score_bound(ours, got.sequences, b[finite]))


def test_left_padded_batch_with_packed_weights_matches_transformers(tiny_pair, eos_ids):
    """The same with oneDNN-packed weights (as bigger float32 models get by default)."""
    hf, ours = tiny_pair
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12], [0, 1, 44, 45, 46, 47, 48]])
    mask = (ids != 0).long()
    ours.cpu_weight_packing = True
    try:
        ref, got = _run_both(tiny_pair, ids, attention_mask=mask, pad_token_id=0, num_beams=4, max_new_tokens=10,
                             eos_token_id=eos_ids[0], num_return_sequences=2)
        assert ours.weights_packed is packing_available()
    finally:
        ours.cpu_weight_packing = None
    _assert_same(ref, got, tiny_pair[1])


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_left_padded_batch_with_repetition_penalty_matches_transformers(tiny_pair, penalty):
    """The repetition penalty skips each row's left padding; with beams it sees ``num_beams`` rows per
    prompt (and diverse beam search one group's beams per call), which must not be refused."""
    _, ours = tiny_pair
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12], [0, 1, 44, 45, 46, 47, 48]])
    mask = (ids != 0).long()
    ref, got = _run_both(tiny_pair, ids, attention_mask=mask, pad_token_id=0, num_beams=3, max_new_tokens=9,
                         eos_token_id=None, num_return_sequences=2, repetition_penalty=penalty)
    _assert_same(ref, got, tiny_pair[1], scale=max(penalty, 1 / penalty))
    diverse = genkit.generate(ours, ids, attention_mask=mask, pad_token_id=0, num_beams=4, num_beam_groups=2,
                              diversity_penalty=1.0, max_new_tokens=6, eos_token_id=None, repetition_penalty=penalty)
    assert diverse.shape == (3, ids.shape[1] + 6)


def test_prompt_cache_with_use_cache_false_is_left_alone(tiny_pair):
    """Beam search with ``use_cache=False`` and a passed ``past_key_values`` re-runs the whole
    left-padded prompt and leaves that cache untouched."""
    hf, ours = tiny_pair
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12], [0, 1, 44, 45, 46, 47, 48]])
    mask = (ids != 0).long()
    kw = dict(num_beams=3, max_new_tokens=6, eos_token_id=None, pad_token_id=0, use_cache=False)
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, **kw)
    prompt_cache = ours.new_cache()
    ours(ids[:, :4], attention_mask=mask[:, :4], past_key_values=prompt_cache)
    got = genkit.generate(ours, ids, attention_mask=mask, past_key_values=prompt_cache, **kw)
    assert torch.equal(got, ref)
    assert prompt_cache.get_seq_length() == 4


@pytest.mark.parametrize("pad", [0, 5])
def test_custom_stopping_criterion_without_eos_matches_transformers(tiny_pair, pad):
    """Without EOS ids, a hypothesis ended early by another stopping criterion is filled with -1
    after its end, whatever the pad id (transformers' fill value)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopSecondPrompt(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, 0] == 1) & (input_ids.shape[1] >= 10)

    hf, ours = tiny_pair
    ids = torch.tensor([[0, 0, 0, 1, 5, 9, 33], [1, 7, 8, 9, 10, 11, 12], [0, 1, 44, 45, 46, 47, 48]])
    mask = (ids != 0).long()
    kw = dict(num_beams=2, max_new_tokens=6, eos_token_id=None, pad_token_id=pad)
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, stopping_criteria=StoppingCriteriaList(
        [StopSecondPrompt()]), **kw)
    got = genkit.generate(ours, ids, attention_mask=mask, stopping_criteria=[StopSecondPrompt()], **kw)
    assert torch.equal(got, ref)
    assert got[1, 10:].tolist() == [-1, -1, -1]


def test_a_candidate_the_processors_ruled_out_never_becomes_a_hypothesis(tiny_pair):
    """More sequences asked than there are candidates: forced_bos_token_id leaves one token at the first
    step, so with 3 beams and one new token transformers returns the forced token twice (the second
    from a beam that is not live, score -1e9). genkit set every candidate that may not be finished to
    -1e9, the score of an empty finished slot, and torch.topk's tie took a token the processor had
    ruled out (log-probability -inf) for the second hypothesis."""
    ref, got = _run_both(tiny_pair, torch.tensor([[5]]), max_new_tokens=1, eos_token_id=None, pad_token_id=0,
                         forced_bos_token_id=3, num_beams=3, num_return_sequences=2)
    assert ref.sequences.tolist() == [[5, 3], [5, 3]]
    assert torch.equal(got.sequences, ref.sequences)
    assert torch.equal(got.sequences_scores, ref.sequences_scores)

