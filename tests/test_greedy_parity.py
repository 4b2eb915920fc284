"""Greedy search end to end against transformers on the same weights: identical tokens for
batch 1 and a left-padded batch of 3, with every processor a config can switch on."""

from __future__ import annotations

import pytest
import torch

import genkit

pytest.importorskip("transformers")

NEW = 16
IDS1 = torch.tensor([[1, 10, 20, 30, 40]])
IDS3 = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
MASK3 = (IDS3 != 0).long()


@pytest.fixture(scope="module")
def emitted(tiny_pair):
    """Tokens the model really emits (computed from a first run, per prompt), to use as EOS."""
    _, ours = tiny_pair
    one = ours.generate(IDS1, max_new_tokens=NEW, eos_token_id=None)[0, IDS1.shape[1]:]
    three = ours.generate(IDS3, attention_mask=MASK3, max_new_tokens=NEW, eos_token_id=None)[:, IDS3.shape[1]:]
    return one, three


def _both(tiny_pair, batch3: bool, **kw):
    hf, ours = tiny_pair
    ids, extra = (IDS3, {"attention_mask": MASK3}) if batch3 else (IDS1, {})
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("pad_token_id", 0)
    ref = hf.generate(ids, do_sample=False, **extra, **kw)
    got = ours.generate(ids, **extra, **kw)
    return got, ref


CASES = {
    "max_new_tokens": lambda e: {"max_new_tokens": 21, "eos_token_id": None},
    "max_length": lambda e: {"max_new_tokens": None, "max_length": 17, "eos_token_id": None},
    "eos": lambda e: {"eos_token_id": int(e[2])},
    "eos_list": lambda e: {"eos_token_id": [int(e[5]), int(e[3])]},
    "min_new_tokens": lambda e: {"eos_token_id": int(e[1]), "min_new_tokens": 6},
    "min_length": lambda e: {"eos_token_id": int(e[1]), "min_length": 11},
    "repetition_penalty": lambda e: {"repetition_penalty": 1.8, "eos_token_id": None},
    "repetition_penalty_soft": lambda e: {"repetition_penalty": 0.6, "eos_token_id": None},
    "no_repeat_ngram_size": lambda e: {"no_repeat_ngram_size": 2, "eos_token_id": None},
    "bad_words_ids": lambda e: {"bad_words_ids": [[int(e[0])], [int(e[2]), int(e[3])]], "eos_token_id": None},
    "sequence_bias": lambda e: {"sequence_bias": {(int(e[1]),): -5.0, (int(e[0]), int(e[4])): 8.0},
                                "eos_token_id": None},
    "suppress_tokens": lambda e: {"suppress_tokens": [int(e[0]), int(e[1])], "eos_token_id": None},
    "begin_suppress_tokens": lambda e: {"begin_suppress_tokens": [int(e[0])], "eos_token_id": None},
    "forced_eos": lambda e: {"forced_eos_token_id": 5, "eos_token_id": 5},
    "exponential_decay": lambda e: {"exponential_decay_length_penalty": (3, 1.8), "eos_token_id": int(e[9])},
    "encoder_repetition_penalty": lambda e: {"encoder_repetition_penalty": 1.5, "eos_token_id": None},
    "encoder_no_repeat_ngram": lambda e: {"encoder_no_repeat_ngram_size": 2, "eos_token_id": None},
    "renormalize_and_invalid": lambda e: {"renormalize_logits": True, "remove_invalid_values": True,
                                          "repetition_penalty": 1.3, "eos_token_id": None},
    "combined": lambda e: {"repetition_penalty": 1.4, "no_repeat_ngram_size": 3, "bad_words_ids": [[int(e[1])]],
                           "min_new_tokens": 4, "eos_token_id": int(e[6])},
}


@pytest.mark.parametrize("batch3", [False, True], ids=["batch1", "padded_batch3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_identical_to_transformers(tiny_pair, emitted, case, batch3):
    e = emitted[0] if not batch3 else emitted[1][0]
    got, ref = _both(tiny_pair, batch3, **CASES[case](e))
    assert torch.equal(got, ref), f"{case}: ours {got.tolist()} vs transformers {ref.tolist()}"


def test_eos_really_stops_early_and_min_new_tokens_delays_it(tiny_pair, emitted):
    one = emitted[0]
    eos = int(one[2])
    first = int((one == eos).nonzero()[0])
    got, _ = _both(tiny_pair, False, eos_token_id=eos)
    assert got.shape[1] == IDS1.shape[1] + first + 1 and int(got[0, -1]) == eos
    got, ref = _both(tiny_pair, False, eos_token_id=eos, min_new_tokens=first + 3)
    assert torch.equal(got, ref)
    assert eos not in got[0, IDS1.shape[1]:IDS1.shape[1] + first + 3].tolist()


def test_user_processors_and_prefix_allowed_tokens_fn(tiny_pair):
    from transformers import LogitsProcessorList as RefList
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor as RefSuppress

    def allowed(batch_id, sent):
        return list(range(3, 60, 2 + batch_id))

    hf, ours = tiny_pair
    ref = hf.generate(IDS3, attention_mask=MASK3, do_sample=False, max_new_tokens=NEW, pad_token_id=0,
                      eos_token_id=None, prefix_allowed_tokens_fn=allowed,
                      logits_processor=RefList([RefSuppress([5, 9, 11])]))
    got = ours.generate(IDS3, attention_mask=MASK3, max_new_tokens=NEW, eos_token_id=None,
                        prefix_allowed_tokens_fn=allowed,
                        logits_processor=[genkit.SuppressTokensLogitsProcessor([5, 9, 11])])
    assert torch.equal(got, ref)


def test_processor_order_and_conditions_match_transformers(tiny_pair):
    """The same config builds the same processor types in the same order as transformers."""
    from genkit.generation.api import prepare

    hf, ours = tiny_pair
    kw = {"repetition_penalty": 1.2, "no_repeat_ngram_size": 2, "bad_words_ids": [[3]], "min_new_tokens": 2,
              "sequence_bias": {(4,): 1.0}, "suppress_tokens": [6], "begin_suppress_tokens": [7], "forced_eos_token_id": 2,
              "exponential_decay_length_penalty": (2, 1.1), "remove_invalid_values": True, "renormalize_logits": True,
              "do_sample": True, "temperature": 0.7, "top_k": 10, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.95,
              "epsilon_cutoff": 0.001, "eta_cutoff": 0.001, "encoder_repetition_penalty": 1.1, "max_new_tokens": 5}
    prepared = prepare(ours, IDS3, None, None, None, None, None, dict(attention_mask=MASK3, **kw))
    ours_types = [type(p).__name__ for p in prepared.logits_processor]

    gc = hf.generation_config.__class__(**kw, eos_token_id=2, pad_token_id=0)
    gc._eos_token_tensor = torch.tensor([2])
    ref = hf._get_logits_processor(generation_config=gc, input_ids_seq_length=IDS3.shape[1],
                                   encoder_input_ids=IDS3, device="cpu", model_kwargs={"attention_mask": MASK3})
    assert ours_types == [type(p).__name__ for p in ref]


def test_prompt_cache_with_use_cache_false_is_left_alone(tiny_pair):
    """``use_cache=False`` with a passed ``past_key_values``: the loop re-runs the whole left-padded
    prompt without touching that cache (it used to run the prompt through it: wrong tokens, or a
    size error on a padded batch)."""
    hf, ours = tiny_pair
    ref = hf.generate(IDS3, attention_mask=MASK3, do_sample=False, max_new_tokens=8, pad_token_id=0,
                      eos_token_id=None)
    for kw in ({}, {"do_sample": True, "top_k": 1}):
        prompt_cache = ours.new_cache()
        ours(IDS3[:, :3], attention_mask=MASK3[:, :3], past_key_values=prompt_cache)
        got = ours.generate(IDS3, attention_mask=MASK3, past_key_values=prompt_cache, use_cache=False,
                            max_new_tokens=8, eos_token_id=None, **kw)
        assert torch.equal(got, ref), kw
        assert prompt_cache.get_seq_length() == 3


class _ReusedLogitsBuffer:
    """A protocol model that returns every position's logits (it ignores ``logits_to_keep``) in one
    output buffer that each forward overwrites, as CUDA-graph replays do."""

    _genkit_protocol = True

    def __init__(self, model):
        self.model = model
        self.buf = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, logits_to_keep=0, **kwargs):
        out = self.model(*args, **kwargs)
        if self.buf is None or self.buf.shape != out.logits.shape:
            self.buf = torch.empty_like(out.logits)
        out.logits = self.buf.copy_(out.logits)
        return out


@pytest.mark.parametrize("kw", [{}, {"do_sample": True, "top_k": 0}], ids=["greedy", "sample"])
def test_kept_scores_do_not_hold_the_model_output(tiny_pair, kw):
    """``output_scores`` without processors: each kept score is its own ``(batch, vocab)`` tensor,
    not a view of the model's output (stale once the next forward reuses the buffer, and holding
    the logits of every prompt position)."""
    _, ours = tiny_pair
    args = dict(max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True, output_scores=True, **kw)
    torch.manual_seed(0)
    ref = ours.generate(IDS3, attention_mask=MASK3, **args)
    torch.manual_seed(0)
    got = genkit.generate(_ReusedLogitsBuffer(ours), IDS3, attention_mask=MASK3, **args)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b)  # (the LM head on all positions: last-bit differences)
        assert a.untyped_storage().nbytes() == a.numel() * a.element_size()
