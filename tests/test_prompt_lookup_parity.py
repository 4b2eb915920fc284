"""Prompt lookup decoding against transformers 5 on the same weights: the drafts are those of
transformers' ``PromptLookupCandidateGenerator`` (the earliest match of the longest n-gram, cut
before a token the logits processors forbid and before EOS), and the sampled verification draws
its random numbers, a draft that runs past ``max_length`` included, so a seed gives
transformers' tokens; greedy tokens stay greedy decoding's."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import genkit
from genkit.builtin_strategies.candidates import PromptLookupCandidateGenerator
from genkit.errors import ConfigError
from genkit.strategy.processing import LogitsProcessorList

transformers = pytest.importorskip("transformers")
from transformers.generation import candidate_generator as hf_candidates  # noqa: E402
from transformers.generation import logits_process as hf_process  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def looping_prompts(tiny_pair):
    """Prompts on which prompt lookup drafts well: the model's own greedy continuation of 4
    random tokens (a tiny random model falls into a loop), one per seed."""
    hf, _ = tiny_pair
    prompts = []
    for seed in range(3):
        start = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(seed))
        prompts.append(hf.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=30,
                                   do_sample=False, eos_token_id=None, pad_token_id=0))
    return prompts


def _counts(caplog) -> tuple[int, int]:
    """(drafted, accepted) of the last assisted run, from the strategy's DEBUG summary."""
    found = re.findall(r"assisted decoding: \d+ rounds, (\d+) drafted, (\d+) accepted", caplog.text)
    return int(found[-1][0]), int(found[-1][1])


def _run_three(tiny_pair, ids, seed, caplog, **kw):
    """transformers; genkit's native model; genkit on transformers' model; one seed each.
    Returns the three outputs and genkit's (drafted, accepted) counts of the native run."""
    hf, ours = tiny_pair
    kw = {"do_sample": True, "pad_token_id": 0, "max_new_tokens": 25, **kw}
    torch.manual_seed(seed)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    with caplog.at_level(logging.DEBUG, logger="genkit.assisted"):
        torch.manual_seed(seed)
        native = ours.generate(ids, **kw)
        counts = _counts(caplog)
    torch.manual_seed(seed)
    adapted = genkit.generate(hf, ids, **kw)
    return ref, native, adapted, counts


# (settings, whether drafts get accepted in every run: top_p forbids most drafts, as in transformers,
# whose lookup runs the processors on logits of ones, where top_p drops most of the vocabulary)
CASES = {
    "temperature": ({"temperature": 0.05}, True),
    "top_k": ({"top_k": 2}, True),
    "top_k,max_matching_ngram_size=4": ({"top_k": 2, "max_matching_ngram_size": 4}, True),
    "top_p": ({"top_p": 0.3}, False),
    "no_repeat_ngram_size": ({"top_k": 2, "no_repeat_ngram_size": 4}, False),
    "draft past max_length": ({"top_k": 4, "max_new_tokens": 5}, False),
    # "last": the prompt's last token as an EOS (see test_a_draft_ends_before_eos_as_in_transformers)
    "min_new_tokens": ({"top_k": 2, "eos_token_id": "last", "min_new_tokens": 8}, False),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_sampled_prompt_lookup_draws_the_tokens_of_transformers(tiny_pair, looping_prompts, caplog, name, seed):
    kw, accepts = CASES[name]
    ids = looping_prompts[seed]
    if kw.get("eos_token_id") == "last":
        kw = {**kw, "eos_token_id": [2, int(ids[0, -1])]}
    ref, native, adapted, (drafted, accepted) = _run_three(tiny_pair, ids, seed, caplog,
                                                           prompt_lookup_num_tokens=6, **kw)
    assert native.tolist() == ref.tolist()
    assert adapted.tolist() == ref.tolist()
    assert drafted > 0
    if accepts:
        assert accepted > 0, "no draft was accepted: the test would not see the draft policy"


def test_a_draft_ends_before_eos_as_in_transformers(tiny_pair, looping_prompts, caplog):
    """The prompt's last token as an EOS: the lookup's drafts (the loop again) hold it second, so
    transformers drafts the one token before it (an EOS drafted too would change the draws)."""
    accepted = 0
    for seed, ids in enumerate(looping_prompts):
        for kw in ({"top_k": 2}, {"temperature": 0.05}):
            ref, native, adapted, counts = _run_three(tiny_pair, ids, seed, caplog, prompt_lookup_num_tokens=6,
                                                      eos_token_id=[2, int(ids[0, -1])], **kw)
            assert native.tolist() == ref.tolist(), (seed, kw)
            assert adapted.tolist() == ref.tolist(), (seed, kw)
            accepted += counts[1]
    assert accepted > 0


def test_greedy_prompt_lookup_gives_greedy_tokens(tiny_pair, looping_prompts, caplog):
    """Greedy verification hides the draft policy: the tokens are greedy decoding's (and transformers')."""
    hf, ours = tiny_pair
    for ids in looping_prompts:
        kw = {"max_new_tokens": 20, "pad_token_id": 0, "eos_token_id": 2}
        greedy = ours.generate(ids, **kw)
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=6, **kw)
        with caplog.at_level(logging.DEBUG, logger="genkit.assisted"):
            out = ours.generate(ids, prompt_lookup_num_tokens=6, **kw)
        assert out.tolist() == ref.tolist() == greedy.tolist()
        assert _counts(caplog)[1] > 0


def _processors(kind: str) -> tuple[object, object]:
    """(genkit's, transformers') processor list for the draft check."""
    if kind == "no_repeat":
        return (LogitsProcessorList([genkit.NoRepeatNGramLogitsProcessor(3)]),
                hf_process.LogitsProcessorList([hf_process.NoRepeatNGramLogitsProcessor(3)]))
    if kind == "top_p":
        return (LogitsProcessorList([genkit.TopPLogitsWarper(0.5)]),
                hf_process.LogitsProcessorList([hf_process.TopPLogitsWarper(0.5)]))
    return None, None


@pytest.mark.parametrize("kind", ["none", "no_repeat", "top_p"])
def test_drafts_are_those_of_transformers_prompt_lookup(kind):
    """Random sequences over 6 token ids (many matches), EOS ids, n-gram sizes, draft lengths and
    ``max_length`` (a draft past it, none when one token is left): the same drafts."""
    g = torch.Generator().manual_seed(0)
    ours_proc, hf_proc = _processors(kind)
    empty = 0
    for trial in range(300):
        length = int(torch.randint(1, 24, (1,), generator=g))
        ids = torch.randint(0, 6, (1, length), generator=g)
        num, ngram = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        eos = [[], [2], [2, 4]][trial % 3]
        max_length = length + 1 + trial % 4
        ours = PromptLookupCandidateGenerator(num, ngram, eos, logits_processor=ours_proc, vocab_size=6,
                                              max_length=max_length)
        theirs = hf_candidates.PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(eos) if eos else None, num_output_tokens=num, max_matching_ngram_size=ngram,
            max_length=max_length, logits_processor=hf_proc, vocab_size=6)
        got, ref = ours.get_candidates(ids)[0], theirs.get_candidates(ids)[0]
        assert got.tolist() == ref.tolist(), (ids.tolist(), num, ngram, eos, max_length)
        empty += got.shape[1] == length
    assert 0 < empty < 300


def test_a_prompt_id_outside_the_vocabulary_is_the_models_error(tiny_pair):
    """The draft check scores draft tokens on logits of the vocabulary's width: a prompt id past it
    is left to the model, which names it (not an IndexError from the check)."""
    _, ours = tiny_pair
    ids = torch.tensor([[5, 200, 7, 5, 200, 7, 5]])
    with pytest.raises(ConfigError, match=r"`input_ids` holds token ids \[200\] outside the model's "
                                                 r"vocabulary \(size 128\)"):
        ours.generate(ids, max_new_tokens=5, prompt_lookup_num_tokens=3, no_repeat_ngram_size=5, do_sample=True)
