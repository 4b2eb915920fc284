"""Every built-in logits processor / warper against transformers' processor of the same name,
on the same random inputs (batch > 1, several parameters, ties and -inf included)."""

from __future__ import annotations

import pytest
import torch
from tolerance import gamma

import genkit
from genkit.builtin_strategies import logits_process as G

T = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 40


def _scores(kind: str, batch: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn((batch, VOCAB), generator=gen) * 3
    if kind == "ties":
        s[:, :8] = s[:, 8:9]  # eight tokens share a score
        s[1] = torch.round(s[1])  # many ties in one row
    elif kind == "neg_inf":
        s[0, :10] = -float("inf")
        s[2, 5] = -float("inf")
    elif kind == "peaked":
        s[:, 3] += 20.0
    return s


def _ids(batch: int = 4, length: int = 12, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    assert torch.equal(torch.isposinf(ours), torch.isposinf(ref))
    # each processor is elementwise arithmetic plus at most one reduction over the vocabulary per row
    # (a softmax, a cumulative sum): each implementation within gamma_(V + 4) of the row's largest |score|
    finite = torch.isfinite(ref)
    scale = float(ref[finite].abs().max()) if bool(finite.any()) else 0.0
    torch.testing.assert_close(ours, ref, equal_nan=True, atol=2 * gamma(VOCAB + 4) * scale, rtol=0)


KINDS = ("plain", "ties", "neg_inf", "peaked")

WARPERS = [
    ("TemperatureLogitsWarper", (0.5,), {}),
    ("TemperatureLogitsWarper", (1.7,), {}),
    ("TopKLogitsWarper", (1,), {}),
    ("TopKLogitsWarper", (5,), {}),
    ("TopKLogitsWarper", (3,), {"min_tokens_to_keep": 6}),
    ("TopKLogitsWarper", (100,), {}),
    ("TopPLogitsWarper", (0.3,), {}),
    ("TopPLogitsWarper", (0.9,), {}),
    ("TopPLogitsWarper", (0.5,), {"min_tokens_to_keep": 4, "filter_value": -100.0}),
    ("MinPLogitsWarper", (0.05,), {}),
    ("MinPLogitsWarper", (0.5,), {"min_tokens_to_keep": 3}),
    ("TypicalLogitsWarper", (0.2,), {}),
    ("TypicalLogitsWarper", (0.9,), {"min_tokens_to_keep": 2}),
    ("EpsilonLogitsWarper", (0.01,), {}),
    ("EpsilonLogitsWarper", (0.2,), {"min_tokens_to_keep": 3}),
    ("EtaLogitsWarper", (0.001,), {}),
    ("EtaLogitsWarper", (0.3,), {"min_tokens_to_keep": 2}),
    ("TopHLogitsWarper", (0.4,), {}),
    ("TopHLogitsWarper", (1.0,), {}),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "args", "kw"), WARPERS, ids=lambda x: str(x))
def test_warpers_match_transformers(name, args, kw, kind):
    scores, ids = _scores(kind), _ids()
    ours = getattr(G, name)(*args, **kw)(ids, scores.clone())
    ref = getattr(T, name)(*args, **kw)(ids, scores.clone())
    _same(ours, ref)


def _prefix_fn(batch_id: int, sent: torch.Tensor) -> list[int]:
    # allowed tokens depend on the row and on its last token
    return [int(sent[-1]) % VOCAB, (batch_id * 7 + 3) % VOCAB, 11]


def _stuck_fn(batch_id: int, sent: torch.Tensor) -> list[int]:
    return [0, 1]


PROCESSORS = [
    ("RepetitionPenaltyLogitsProcessor", lambda ids: ((1.5,), {})),
    ("RepetitionPenaltyLogitsProcessor", lambda ids: ((0.7,), {})),
    ("RepetitionPenaltyLogitsProcessor", lambda ids: ((1.3,), {"prompt_ignore_length": 5})),
    ("RepetitionPenaltyLogitsProcessor",
     lambda ids: ((1.3,), {"prompt_ignore_length": torch.tensor([0, 3, 7, 11])})),
    ("EncoderRepetitionPenaltyLogitsProcessor", lambda ids: ((1.4,), {"encoder_input_ids": ids[:, :6]})),
    ("EncoderRepetitionPenaltyLogitsProcessor", lambda ids: ((1.4,), {"encoder_input_ids": ids[:2, :6]})),
    ("NoRepeatNGramLogitsProcessor", lambda ids: ((1,), {})),
    ("NoRepeatNGramLogitsProcessor", lambda ids: ((2,), {})),
    ("NoRepeatNGramLogitsProcessor", lambda ids: ((3,), {})),
    ("NoRepeatNGramLogitsProcessor", lambda ids: ((20,), {})),
    ("EncoderNoRepeatNGramLogitsProcessor", lambda ids: ((2,), {"encoder_input_ids": ids[:, :8]})),
    ("EncoderNoRepeatNGramLogitsProcessor", lambda ids: ((3,), {"encoder_input_ids": ids[:2, 2:10]})),
    ("NoBadWordsLogitsProcessor", lambda ids: (([[5], [int(ids[0, -1]), 7], [int(ids[1, -2]), int(ids[1, -1]), 9],
                                                 [2]],), {"eos_token_id": 2})),
    ("NoBadWordsLogitsProcessor", lambda ids: (([[3, 4, 5, 6]],), {})),
    ("SequenceBiasLogitsProcessor", lambda ids: (({(4,): -3.5, (int(ids[2, -1]), 9): 10.0,
                                                   (int(ids[0, -2]), int(ids[0, -1]), 1): -2.0},), {})),
    ("SequenceBiasLogitsProcessor", lambda ids: (([[[1], 2.5], [[int(ids[3, -1]), 6], -1.5]],), {})),
    ("MinLengthLogitsProcessor", lambda ids: ((13,), {"eos_token_id": [2, 7]})),
    ("MinLengthLogitsProcessor", lambda ids: ((12,), {"eos_token_id": 2})),
    ("MinNewTokensLengthLogitsProcessor", lambda ids: ((10, 5), {"eos_token_id": 3})),
    ("MinNewTokensLengthLogitsProcessor", lambda ids: ((10, 2), {"eos_token_id": [3, 4]})),
    ("PrefixConstrainedLogitsProcessor", lambda ids: ((_prefix_fn, 1), {})),
    ("PrefixConstrainedLogitsProcessor", lambda ids: ((_prefix_fn, 2), {})),
    ("ForcedEOSTokenLogitsProcessor", lambda ids: ((13,), {"eos_token_id": [2, 5]})),
    ("ForcedEOSTokenLogitsProcessor", lambda ids: ((20,), {"eos_token_id": 2})),
    ("InfNanRemoveLogitsProcessor", lambda ids: ((), {})),
    ("ExponentialDecayLengthPenalty", lambda ids: (((2, 1.5),), {"eos_token_id": [2, 9],
                                                                 "input_ids_seq_length": 6})),
    ("ExponentialDecayLengthPenalty", lambda ids: (((20, 1.5),), {"eos_token_id": 2, "input_ids_seq_length": 6})),
    ("SuppressTokensLogitsProcessor", lambda ids: (([1, 4, 39, 100],), {})),
    ("SuppressTokensAtBeginLogitsProcessor", lambda ids: (([1, 4],), {"begin_index": 12})),
    ("SuppressTokensAtBeginLogitsProcessor", lambda ids: (([1, 4],), {"begin_index": 3})),
    ("LogitNormalization", lambda ids: ((), {})),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("name", "make"), PROCESSORS, ids=lambda x: x if isinstance(x, str) else "")
def test_processors_match_transformers(name, make, kind):
    scores, ids = _scores(kind), _ids()
    args, kw = make(ids)
    ours = getattr(G, name)(*args, **kw)(ids, scores.clone())
    ref = getattr(T, name)(*args, **kw)(ids, scores.clone())
    _same(ours, ref)


def test_forced_bos_matches_transformers():
    scores = _scores("plain")
    for length in (1, 2):
        ids = _ids(length=length)
        _same(G.ForcedBOSTokenLogitsProcessor(7)(ids, scores.clone()),
              T.ForcedBOSTokenLogitsProcessor(7)(ids, scores.clone()))


def test_inf_nan_removal_matches_transformers():
    scores = _scores("plain")
    scores[0, 1] = float("nan")
    scores[1, 2] = float("inf")
    scores[2, 3] = -float("inf")
    ids = _ids()
    ours = G.InfNanRemoveLogitsProcessor()(ids, scores.clone())
    ref = T.InfNanRemoveLogitsProcessor()(ids, scores.clone())
    assert torch.equal(ours, ref)
    assert torch.isfinite(ours).all()


def test_prefix_allowed_unsatisfiable_falls_back_like_transformers():
    scores = _scores("plain")
    scores[:, :2] = -float("inf")
    ids = _ids()
    _same(G.PrefixConstrainedLogitsProcessor(_stuck_fn, 1)(ids, scores.clone()),
          T.PrefixConstrainedLogitsProcessor(_stuck_fn, 1)(ids, scores.clone()))
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
        G.PrefixConstrainedLogitsProcessor(lambda b, s: [], 1)(ids, scores)


def test_repetition_penalty_over_generation_steps_with_left_padding():
    """The left-padding-aware penalty, step after step as in a loop, matches transformers."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=gen)
    ids[0, :3] = 0  # pad token 0 on the left
    ids[2, :1] = 0
    mask = (ids != 0).long()
    pad = (mask != 0).int().argmax(dim=1)
    ours_p = G.RepetitionPenaltyLogitsProcessor(1.8, prompt_ignore_length=pad)
    ref_p = T.RepetitionPenaltyLogitsProcessor(1.8, prompt_ignore_length=pad)
    for step in range(4):
        scores = torch.randn((3, VOCAB), generator=gen)
        ours = ours_p(ids, scores.clone())
        _same(ours, ref_p(ids, scores.clone()))
        if step == 0:  # the pad token is not penalised in a padded row that does not contain it
            assert ours[0, 0] == scores[0, 0]
        ids = torch.cat([ids, ours.argmax(-1, keepdim=True)], dim=1)


def test_processors_are_exported_lazily_from_genkit():
    for name in genkit._PROCESSOR_NAMES:
        assert getattr(genkit, name) is getattr(G, name)


def test_processors_work_on_bfloat16_and_keep_dtype():
    scores, ids = _scores("plain").to(torch.bfloat16), _ids()
    for proc in (G.TopKLogitsWarper(5), G.TopPLogitsWarper(0.7), G.RepetitionPenaltyLogitsProcessor(1.2),
                 G.SequenceBiasLogitsProcessor({(3,): 1.0, (1, 2): -1.0}), G.InfNanRemoveLogitsProcessor()):
        assert proc(ids, scores).dtype == torch.bfloat16


BAD_CONSTRUCTORS = [
    (lambda: G.TemperatureLogitsWarper(0.0), "temperature", "> 0"),
    (lambda: G.TemperatureLogitsWarper(-1), "temperature", "> 0"),
    (lambda: G.TopKLogitsWarper(0), "top_k", ">= 1"),
    (lambda: G.TopKLogitsWarper(2.5), "top_k", "int"),
    (lambda: G.TopKLogitsWarper(5, min_tokens_to_keep=0), "min_tokens_to_keep", ">= 1"),
    (lambda: G.TopPLogitsWarper(1.5), "top_p", "[0, 1]"),
    (lambda: G.TopPLogitsWarper(-0.1), "top_p", "[0, 1]"),
    (lambda: G.MinPLogitsWarper(2.0), "min_p", "[0, 1]"),
    (lambda: G.TypicalLogitsWarper(1.0), "typical_p", "(0, 1)"),
    (lambda: G.EpsilonLogitsWarper(0.0), "epsilon_cutoff", "(0, 1)"),
    (lambda: G.EtaLogitsWarper(1.0), "eta_cutoff", "(0, 1)"),
    (lambda: G.TopHLogitsWarper(0.0), "top_h", "(0, 1]"),
    (lambda: G.RepetitionPenaltyLogitsProcessor(0.0), "penalty", "> 0"),
    (lambda: G.RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=-1), "prompt_ignore_length", ">= 0"),
    (lambda: G.NoRepeatNGramLogitsProcessor(0), "ngram_size", ">= 1"),
    (lambda: G.EncoderNoRepeatNGramLogitsProcessor(0, torch.zeros(1, 3, dtype=torch.long)), "encoder_ngram_size",
     ">= 1"),
    (lambda: G.NoBadWordsLogitsProcessor([[-1]]), "bad_words_ids", "token ids >= 0"),
    (lambda: G.NoBadWordsLogitsProcessor([]), "bad_words_ids", "non-empty"),
    (lambda: G.NoBadWordsLogitsProcessor([[]]), "bad_words_ids", "non-empty lists"),
    (lambda: G.SequenceBiasLogitsProcessor({}), "sequence_bias", "non-empty"),
    (lambda: G.SequenceBiasLogitsProcessor({(1,): "x"}), "sequence_bias", "bias"),
    (lambda: G.SequenceBiasLogitsProcessor({3: 1.0}), "sequence_bias", "tuple of token ids"),
    (lambda: G.MinLengthLogitsProcessor(-1, 2), "min_length", ">= 0"),
    (lambda: G.MinLengthLogitsProcessor(3, -2), "eos_token_id", ">= 0"),
    (lambda: G.MinNewTokensLengthLogitsProcessor(-1, 2, 2), "prompt_length_to_skip", ">= 0"),
    (lambda: G.ForcedEOSTokenLogitsProcessor(10, [1.5]), "eos_token_id", "token id"),
    (lambda: G.ForcedBOSTokenLogitsProcessor(-3), "bos_token_id", ">= 0"),
    (lambda: G.ExponentialDecayLengthPenalty((1,), 2, 3), "exponential_decay_length_penalty", "pair"),
    (lambda: G.SuppressTokensLogitsProcessor([-4]), "suppress_tokens", ">= 0"),
    (lambda: G.SuppressTokensAtBeginLogitsProcessor([1], -1), "begin_index", ">= 0"),
    (lambda: G.PrefixConstrainedLogitsProcessor(None, 1), "prefix_allowed_tokens_fn", "callable"),
]


@pytest.mark.parametrize(("make", "field", "accepted"), BAD_CONSTRUCTORS)
def test_constructor_validation_names_argument_and_accepted_values(make, field, accepted):
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    assert f"`{field}`" in msg and accepted in msg


@pytest.mark.parametrize("bias", [1e308, -1e39, float("nan")])
def test_a_sequence_bias_float32_cannot_hold_is_a_config_error(bias):
    """(fuzzing generation_config.json) a bias of 1e308 was a RuntimeError in the first step ("value
    cannot be converted to type float without overflow"); -inf / inf still ban / force a token"""
    from genkit.errors import ConfigError
    from genkit.models.tiny import tiny_llama
    model = tiny_llama(seed=0)
    with pytest.raises(ConfigError, match=r"`sequence_bias` must be .*each bias a number within float32's range"):
        genkit.generate(model, torch.tensor([[1, 5, 6]]), max_new_tokens=2, sequence_bias={(5,): bias})
    out = genkit.generate(model, torch.tensor([[1, 5, 6]]), max_new_tokens=2, do_sample=False,
                          sequence_bias={(5,): float("-inf"), (7,): 3.4e38})
    assert out[0, 3:].tolist() == [7, 7]


def test_sequence_bias_rejects_ids_outside_vocabulary():
    proc = G.SequenceBiasLogitsProcessor({(VOCAB + 5,): 1.0})
    with pytest.raises(ValueError, match=r"sequence_bias.*outside the model's vocabulary"):
        proc(_ids(), _scores("plain"))
