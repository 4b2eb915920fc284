"""Beam sampling, diverse (group) beam search, constrained beam search, strategy selection and errors."""

from __future__ import annotations

import pytest
import torch
from tolerance import score_bound, sum_bound

import genkit
from genkit.strategy.outputs import compute_transition_scores

PROMPT = torch.tensor([[1, 5, 9, 33, 70]])
DICT = {"return_dict_in_generate": True, "output_scores": True}


def _contains(seq: list[int], phrase: list[int]) -> bool:
    m = len(phrase)
    return any(seq[i:i + m] == phrase for i in range(len(seq) - m + 1))


def _rebuilt(out, length_penalty=1.0):
    trans = compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    return trans.sum(dim=1) / (out.beam_indices >= 0).sum(dim=1).float() ** length_penalty


def _sum_atol(out):
    """The same log-probs summed in two orders (tests/tolerance.py)."""
    return sum_bound(len(out.scores), out.sequences_scores)


# ---------------------------------------------------------------------------------------------
# strategy selection and refusals
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    ({"num_beams": 3}, "beam_search"),
    ({"num_beams": 3, "do_sample": True}, "beam_sample"),
    ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}, "group_beam_search"),
    ({"num_beams": 3, "force_words_ids": [[5]]}, "constrained_beam_search"),
    ({"num_beams": 4, "num_beam_groups": 2, "force_words_ids": [[5]]}, "constrained_beam_search"),
])
def test_strategy_selection(kw, name):
    assert genkit.GenerationConfig(**kw).get_generation_mode() == name


def test_streamer_with_beams_is_refused(tiny_model):
    class Collect:
        def __init__(self):
            self.ended = False

        def put(self, ids):
            pass

        def end(self):
            self.ended = True

    for kw in ({"num_beams": 2}, {"num_beams": 2, "do_sample": True},
               {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}, {"num_beams": 2, "force_words_ids": [[7]]}):
        streamer = Collect()
        with pytest.raises(ValueError, match="`streamer` cannot be used with .*num_beams > 1"):
            genkit.generate(tiny_model, PROMPT, max_new_tokens=4, streamer=streamer, **kw)
        assert streamer.ended  # the core still closes the streamer


@pytest.mark.parametrize("kw,msg", [
    ({"num_beams": 2, "num_return_sequences": 3}, r"`num_return_sequences` \(3\) must be <= `num_beams` \(2\)"),
    ({"num_beams": 4, "num_beam_groups": 3}, r"`num_beams` \(4\) must be divisible by `num_beam_groups` \(3\)"),
    ({"num_beams": 4, "num_beam_groups": 2, "do_sample": True}, "requires do_sample=False"),
    ({"num_beams": 2, "force_words_ids": [[5]], "do_sample": True}, "needs num_beams > 1 and do_sample=False"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"num_beams": 2, "force_words_ids": [[5, "x"]]}, "`force_words_ids` must be"),
    ({"num_beams": 2, "force_words_ids": [[]]}, "`force_words_ids` must be"),
    ({"num_beams": 2, "force_words_ids": [[5000]]}, r"`force_words_ids` holds token ids \[5000\] outside the model's vocabulary \(size 128\)"),
])
def test_invalid_combinations(tiny_model, kw, msg):
    with pytest.raises(ValueError, match=msg):
        genkit.generate(tiny_model, PROMPT, max_new_tokens=4, **kw)


def test_without_return_dict_returns_sequences(tiny_model):
    out = genkit.generate(tiny_model, PROMPT, max_new_tokens=5, num_beams=3, num_return_sequences=2)
    assert isinstance(out, torch.Tensor) and out.shape == (2, PROMPT.shape[1] + 5)
    full = genkit.generate(tiny_model, PROMPT, max_new_tokens=5, num_beams=3, num_return_sequences=2,
                           return_dict_in_generate=True)
    assert torch.equal(full.sequences, out) and full.sequences_scores is None and full.beam_indices is not None


# ---------------------------------------------------------------------------------------------
# beam sampling
# ---------------------------------------------------------------------------------------------
def test_beam_sample_seeded_and_matches_transformers(tiny_pair):
    hf, ours = tiny_pair
    kw = dict(num_beams=3, do_sample=True, max_new_tokens=10, num_return_sequences=2, eos_token_id=None,
              pad_token_id=0, **DICT)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(genkit.generate(ours, PROMPT, **kw))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert torch.equal(runs[0].sequences_scores, runs[1].sequences_scores)
    # transformers draws the same samples from the same seed (same distributions, same RNG calls)
    for seed in (0, 7):
        torch.manual_seed(seed)
        ref = hf.generate(PROMPT, **kw)
        torch.manual_seed(seed)
        got = genkit.generate(ours, PROMPT, **kw)
        assert torch.equal(got.sequences, ref.sequences)
        torch.testing.assert_close(got.sequences_scores, ref.sequences_scores, rtol=0,
                                   atol=score_bound(ours, got.sequences, got.sequences_scores))


def test_beam_sample_explores_where_beam_search_does_not(tiny_model):
    kw = {"num_beams": 3, "max_new_tokens": 6, "eos_token_id": None}
    beam = {tuple(genkit.generate(tiny_model, PROMPT, **kw)[0].tolist()) for _ in range(3)}
    assert len(beam) == 1
    sampled = set()
    for seed in range(50):
        torch.manual_seed(seed)
        sampled.add(tuple(genkit.generate(tiny_model, PROMPT, do_sample=True, **kw)[0].tolist()))
    assert len(sampled) >= 5, len(sampled)


def test_beam_sample_scores_follow_processed_sampled_tokens(tiny_model):
    temperature, top_k = 0.7, 10
    torch.manual_seed(3)
    out = genkit.generate(tiny_model, PROMPT, num_beams=4, do_sample=True, max_new_tokens=8, num_return_sequences=3,
                          temperature=temperature, top_k=top_k, eos_token_id=None, output_logits=True, **DICT)
    # each step's scores are the processed log-probs: log_softmax(logits) / T, then top-k
    for logits, scores in zip(out.logits, out.scores):
        expected = torch.log_softmax(logits, dim=-1) / temperature
        kth = expected.topk(top_k, dim=-1).values[:, -1:]
        expected = expected.masked_fill(expected < kth, -float("inf"))
        assert torch.equal(torch.isfinite(scores), torch.isfinite(expected))
        finite = torch.isfinite(expected)
        torch.testing.assert_close(scores[finite], expected[finite])
    # every sampled token was allowed by the processors, and the scores add up to sequences_scores
    trans = compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    assert bool(torch.isfinite(trans).all())
    torch.testing.assert_close(_rebuilt(out), out.sequences_scores, rtol=0, atol=_sum_atol(out))


# ---------------------------------------------------------------------------------------------
# diverse (group) beam search
# ---------------------------------------------------------------------------------------------
def test_one_group_equals_beam_search(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.tensor([[0, 0, 1, 5, 9], [1, 7, 8, 9, 10]])
    kw = dict(num_beams=4, max_new_tokens=9, num_return_sequences=3, eos_token_id=None, pad_token_id=0,
              attention_mask=(ids != 0).long(), **DICT)
    beam = genkit.generate(ours, ids, **kw)
    group = genkit.generate(ours, ids, custom_generate="group_beam_search", **kw)
    ref = hf.generate(ids, do_sample=False, **kw)
    for out in (group, ref):
        assert torch.equal(beam.sequences, out.sequences)
        torch.testing.assert_close(beam.sequences_scores, out.sequences_scores, rtol=0,
                                   atol=score_bound(ours, beam.sequences, beam.sequences_scores))


def test_groups_start_with_different_tokens(tiny_model):
    kw = dict(num_beams=4, max_new_tokens=6, num_return_sequences=4, eos_token_id=None, **DICT)
    plain = genkit.generate(tiny_model, PROMPT, **kw)
    assert len(set(plain.sequences[:, PROMPT.shape[1]].tolist())) < 4  # beam search alone converges
    diverse = genkit.generate(tiny_model, PROMPT, num_beam_groups=4, diversity_penalty=50.0, **kw)
    first = diverse.sequences[:, PROMPT.shape[1]].tolist()
    assert len(set(first)) == 4, first
    groups = (diverse.beam_indices[:, 0] % 4).tolist()  # one beam per group: flat row == group
    assert sorted(groups) == [0, 1, 2, 3]
    torch.testing.assert_close(_rebuilt(diverse), diverse.sequences_scores)


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_hamming_penalty_hand_checked(tiny_model, penalty):
    """Two groups of one beam, one step: group 1 sees group 0's token lowered by the penalty."""
    out = genkit.generate(tiny_model, PROMPT, num_beams=2, num_beam_groups=2, diversity_penalty=penalty,
                          max_new_tokens=1, num_return_sequences=2, eos_token_id=None, output_logits=True, **DICT)
    logits = out.logits[0]
    lp0, lp1 = torch.log_softmax(logits[0], -1), torch.log_softmax(logits[1], -1)
    torch.testing.assert_close(lp0, lp1)  # both groups start from the same prompt
    t0 = int(lp0.argmax())
    second = int(lp0.topk(2).indices[1])
    gap = float(lp0[t0] - lp0[second])
    # group 1's processed scores: the same log-probs with t0 lowered by exactly `penalty`
    expected1 = lp1.clone()
    expected1[t0] -= penalty
    torch.testing.assert_close(out.scores[0][0], lp0)
    torch.testing.assert_close(out.scores[0][1], expected1)
    by_group = {int(r): (int(s[-1]), float(sc)) for r, s, sc in
                zip(out.beam_indices[:, 0], out.sequences, out.sequences_scores)}
    assert by_group[0] == (t0, pytest.approx(float(lp0[t0]), abs=1e-5))
    t1 = t0 if penalty < gap else second
    assert by_group[1][0] == t1
    assert by_group[1][1] == pytest.approx(float(expected1[t1]), abs=1e-5)


# prefix_allowed_tokens_fn with groups: each group's rows keep their own prompt's batch id
_PREFIX_PROMPTS = torch.tensor([[1, 5, 9, 33, 70], [1, 8, 2, 90, 11]])
_PREFIX_ALLOWED = {0: list(range(10, 30)), 1: list(range(60, 80))}


def _recording_prefix_fn(calls):
    def fn(batch_id, input_ids):
        calls.append((batch_id, tuple(input_ids.tolist())))
        return _PREFIX_ALLOWED[batch_id]
    return fn


@pytest.mark.parametrize("batch", [2, 1])
def test_prefix_allowed_tokens_with_beam_groups_keeps_batch_ids(tiny_model, batch):
    ids = _PREFIX_PROMPTS[:batch]
    prompt_len, beams, steps = ids.shape[1], 4, 6
    calls: list[tuple[int, tuple[int, ...]]] = []
    out = genkit.generate(tiny_model, ids, num_beams=beams, num_beam_groups=2, diversity_penalty=1.0,
                          num_return_sequences=beams, max_new_tokens=steps, eos_token_id=None,
                          prefix_allowed_tokens_fn=_recording_prefix_fn(calls), **DICT)
    assert out.sequences.shape == (batch * beams, prompt_len + steps)
    for i, row in enumerate(out.sequences.tolist()):
        b = i // beams
        assert row[:prompt_len] == ids[b].tolist()
        assert set(row[prompt_len:]) <= set(_PREFIX_ALLOWED[b]), (b, row)
    # the callback saw each row under its own prompt's batch id, once per beam per step
    assert sorted({b for b, _ in calls}) == list(range(batch))
    for b in range(batch):
        assert sum(1 for cb, _ in calls if cb == b) == beams * steps
    for b, row in calls:
        assert list(row[:prompt_len]) == ids[b].tolist(), (b, row)
        assert set(row[prompt_len:]) <= set(_PREFIX_ALLOWED[b]), (b, row)
    assert bool(torch.isfinite(out.sequences_scores).all())


def test_prefix_allowed_tokens_with_beam_groups_matches_transformers(tiny_pair):
    """transformers 5.x runs diverse beam search only as a Hub recipe (not reachable offline), so
    the reference is its beam search: with ``diversity_penalty=0`` every group of ``k`` beams is a
    beam search with ``k`` beams, and each must give transformers' hypotheses for every prompt."""
    hf, ours = tiny_pair
    ids = _PREFIX_PROMPTS
    kw = dict(max_new_tokens=7, eos_token_id=None, pad_token_id=0, do_sample=False, **DICT)
    ref = hf.generate(ids, num_beams=2, num_return_sequences=2, prefix_allowed_tokens_fn=_recording_prefix_fn([]),
                      **kw)
    got = genkit.generate(ours, ids, num_beams=4, num_beam_groups=2, diversity_penalty=0.0, num_return_sequences=4,
                          prefix_allowed_tokens_fn=_recording_prefix_fn([]), **kw)
    ref_seqs = ref.sequences.view(2, 2, -1)
    got_seqs = got.sequences.view(2, 4, -1)
    got_scores = got.sequences_scores.view(2, 4)
    for b in range(2):
        # two identical groups: each hypothesis of transformers' comes back twice, best first
        for j in range(2):
            for k in (2 * j, 2 * j + 1):
                assert got_seqs[b, k].tolist() == ref_seqs[b, j].tolist(), (b, j, got_seqs[b], ref_seqs[b])
                torch.testing.assert_close(got_scores[b, k], ref.sequences_scores[2 * b + j], rtol=0,
                                           atol=score_bound(ours, got.sequences, got.sequences_scores))
        assert set(got_seqs[b, :, ids.shape[1]:].reshape(-1).tolist()) <= set(_PREFIX_ALLOWED[b])


@pytest.mark.parametrize("num_beams", [1, 2])
def test_prefix_allowed_tokens_with_several_return_sequences_matches_transformers(tiny_pair, num_beams):
    """Sampling ``num_return_sequences`` copies of each prompt: the callback gets each copy under
    its own prompt's batch id (transformers >= 5.24 counts ``max(num_beams, num_return_sequences)``
    rows per prompt), and the samples are transformers' from the same seed."""
    hf, ours = tiny_pair
    ids = _PREFIX_PROMPTS
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, do_sample=True, num_beams=num_beams,
              num_return_sequences=3 if num_beams == 1 else 2, **DICT)
    ref_calls: list[tuple[int, tuple[int, ...]]] = []
    calls: list[tuple[int, tuple[int, ...]]] = []
    torch.manual_seed(11)
    ref = hf.generate(ids, prefix_allowed_tokens_fn=_recording_prefix_fn(ref_calls), **kw)
    torch.manual_seed(11)
    got = genkit.generate(ours, ids, prefix_allowed_tokens_fn=_recording_prefix_fn(calls), **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    for b, row in calls:
        assert list(row[:ids.shape[1]]) == ids[b].tolist(), (b, row)
    per_prompt = got.sequences.shape[0] // ids.shape[0]
    for i, row in enumerate(got.sequences.tolist()):
        assert set(row[ids.shape[1]:]) <= set(_PREFIX_ALLOWED[i // per_prompt])


# ---------------------------------------------------------------------------------------------
# constrained beam search
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("force", [[[40, 41, 42], [77]], [[100, 3]], [[9, 9], [64], [120, 121]]])
def test_forced_phrases_appear_in_every_sequence(tiny_model, force):
    ids = torch.tensor([[1, 5, 9, 33, 70], [1, 8, 2, 90, 11]])
    out = genkit.generate(tiny_model, ids, num_beams=4, num_return_sequences=4, max_new_tokens=12,
                          force_words_ids=force, eos_token_id=None, **DICT)
    assert out.sequences.shape[0] == 8
    for row in out.sequences[:, ids.shape[1]:].tolist():
        for phrase in force:
            assert _contains(row, phrase), (row, phrase)
    torch.testing.assert_close(_rebuilt(out), out.sequences_scores, rtol=0, atol=_sum_atol(out))


def test_disjunctive_set_satisfied_by_one_member(tiny_model):
    options = [[50, 51], [60], [70, 71, 72]]
    force = [options, [99]]
    out = genkit.generate(tiny_model, PROMPT, num_beams=4, num_return_sequences=4, max_new_tokens=10,
                          force_words_ids=force, eos_token_id=None, **DICT)
    for row in out.sequences[:, PROMPT.shape[1]:].tolist():
        assert _contains(row, [99])
        assert any(_contains(row, o) for o in options), row


def test_constrained_only_finishes_complete_hypotheses(tiny_model):
    """With an EOS the model emits early, hypotheses may only end once the phrase is in."""
    free = genkit.generate(tiny_model, PROMPT, num_beams=4, max_new_tokens=12, eos_token_id=None)
    eos = int(free[0, PROMPT.shape[1] + 1])  # a token beam search produces at the 2nd step
    out = genkit.generate(tiny_model, PROMPT, num_beams=4, num_return_sequences=2, max_new_tokens=12,
                          eos_token_id=eos, pad_token_id=0, force_words_ids=[[30, 31]], **DICT)
    for row in out.sequences[:, PROMPT.shape[1]:].tolist():
        assert _contains(row, [30, 31])
        if eos in row:
            assert row.index(eos) > max(i for i in range(len(row) - 1) if row[i:i + 2] == [30, 31])
