"""Diverse (group) beam search: genkit's built-in strategy against transformers 4.x's algorithm run by
transformers itself (issue 31).

transformers 5 moved group beam search out of its ``generate`` into a Hub recipe, which cannot be
fetched here. The reference is tests/group_beam_recipe.py: transformers 4.x's ``_group_beam_search``
and ``BeamSearchScorer`` written on transformers 5's ``GenerationMixin`` internals (checked once
against transformers 4.46.3's built-in group beam search: docs/encoder_decoder.md), run through
transformers' own ``generate(custom_generate=<folder>, trust_remote_code=True)`` on tiny random
T5 / BART / Pegasus / Marian / Whisper / ViT+GPT-2 models and a tiny Llama. Sequences and beam
indices must be identical, ``sequences_scores`` and the transition scores within 1e-5.
"""

from __future__ import annotations

import pytest
import seq2seq_models as S
import torch
from hub_server import group_beam_recipe
from seq2seq_models import SCORE_ATOL, SCORE_RTOL
from tolerance import score_bound

import genkit

transformers = pytest.importorskip("transformers")
from transformers.generation.utils import GenerationMixin  # noqa: E402

DICT = {"return_dict_in_generate": True, "output_scores": True}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    return group_beam_recipe(tmp_path_factory.mktemp("group-beam-search"))


@pytest.fixture(scope="module")
def models():
    return {name: S.build(name) for name in S.ALL}


def _reference(model, recipe, **kw):
    return GenerationMixin.generate(model, custom_generate=recipe, trust_remote_code=True, do_sample=False, **kw)


def _assert_same(model, ours, ref, atol=SCORE_ATOL, rtol=SCORE_RTOL):
    assert type(ours).__name__ == type(ref).__name__
    assert torch.equal(ours.sequences, ref.sequences), (ours.sequences, ref.sequences)
    assert torch.equal(ours.beam_indices, ref.beam_indices), (ours.beam_indices, ref.beam_indices)
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, atol=atol, rtol=rtol)
    mine = genkit.compute_transition_scores(ours.sequences, ours.scores, ours.beam_indices)
    theirs = model.compute_transition_scores(ref.sequences, ref.scores, ref.beam_indices)
    torch.testing.assert_close(mine, theirs, atol=atol, rtol=rtol)


def _early_eos(model, x, **kw):
    """A token that ends some hypotheses of this run early: the 4th token of its best one."""
    return int(genkit.generate(model, **x, max_new_tokens=8, **kw)[0, 3])


@pytest.mark.parametrize("name", S.ALL)
def test_diverse_beams_match_transformers_4_algorithm(models, recipe, name):
    """A left-padded batch (text; Whisper's features, ViT's pixels), two groups, every hypothesis
    returned."""
    model, x = models[name], S.inputs(name)
    kw = dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=4, max_new_tokens=8,
              length_penalty=1.0, **DICT)
    ours = genkit.generate(model, **x, **kw)
    _assert_same(model, ours, _reference(model, recipe, **x, **kw))
    assert type(ours).__name__ == "GenerateBeamEncoderDecoderOutput"
    # the second group's rows appear among the returned hypotheses' beams
    assert ((ours.beam_indices % 4) >= 2).any()


@pytest.mark.parametrize(("name", "length_penalty", "early_stopping"), [
    ("t5", 1.0, False), ("bart", 2.0, True), ("pegasus", 0.5, "never"), ("marian", -1.0, False),
    ("t5", 2.0, "never"), ("bart", 0.0, False),
])
def test_eos_per_row_length_penalty_and_early_stopping(models, recipe, name, length_penalty, early_stopping):
    """Hypotheses end with EOS at different steps (then pads); three groups of two beams."""
    model, x = models[name], S.inputs(name)
    kw = dict(num_beams=6, num_beam_groups=3, diversity_penalty=0.75, num_return_sequences=3, max_new_tokens=8,
              length_penalty=length_penalty, early_stopping=early_stopping, **DICT)
    eos = _early_eos(model, x, num_beams=2)
    ours = genkit.generate(model, **x, eos_token_id=eos, **kw)
    _assert_same(model, ours, _reference(model, recipe, **x, eos_token_id=eos, **kw))
    ended = (ours.sequences[:, 1:] == eos).any(dim=1)
    assert ended.any(), ours.sequences  # the run did end hypotheses with EOS


def test_a_done_group_counts_as_the_pad_token(models, recipe):
    """With ``early_stopping=True`` a group is done as soon as it holds its hypotheses; from then on
    the later groups' penalty counts its beams as the pad token (4.x). Here the second group goes on
    after the first is done and would pick token 7: with ``pad_token_id=7`` its scores differ from
    those with ``pad_token_id=8``, and both match the recipe."""
    model, x = models["bart"], S.inputs("bart", batch=1)
    eos = int(genkit.generate(model, **x, max_new_tokens=8, num_beams=2)[0, 2])
    kw = dict(num_beams=6, num_beam_groups=2, diversity_penalty=3.0, num_return_sequences=6, max_new_tokens=10,
              early_stopping=True, eos_token_id=eos, **DICT)
    runs = []
    for pad in (7, 8):
        runs.append(genkit.generate(model, **x, pad_token_id=pad, **kw))
        _assert_same(model, runs[-1], _reference(model, recipe, **x, pad_token_id=pad, **kw))
    assert not torch.allclose(runs[0].sequences_scores, runs[1].sequences_scores)


def test_diverse_beams_on_llama_native_and_transformers(tiny_pair, recipe):
    """Decoder-only: the recipe on transformers' Llama; genkit on the same model and on its own
    Llama with the same weights (other kernels: the scores within the forward's error bound)."""
    hf, ours = tiny_pair
    ids = torch.tensor([[0, 0, 1, 17, 42, 7], [1, 99, 3, 64, 5, 8]])
    kw = dict(attention_mask=(ids != 0).long(), pad_token_id=0, num_beams=4, num_beam_groups=2,
              diversity_penalty=1.5, num_return_sequences=2, max_new_tokens=7, **DICT)
    eos = int(genkit.generate(hf, ids, max_new_tokens=7, num_beams=2, attention_mask=kw["attention_mask"],
                              pad_token_id=0)[0, ids.shape[1] + 2])
    ref = _reference(hf, recipe, inputs=ids, eos_token_id=eos, **kw)
    _assert_same(hf, genkit.generate(hf, ids, eos_token_id=eos, **kw), ref)
    native = genkit.generate(ours, ids, eos_token_id=eos, **kw)
    assert torch.equal(native.sequences, ref.sequences) and torch.equal(native.beam_indices, ref.beam_indices)
    torch.testing.assert_close(native.sequences_scores, ref.sequences_scores, rtol=0,
                               atol=score_bound(ours, native.sequences, native.sequences_scores))
    assert (ref.sequences[:, ids.shape[1]:] == eos).any()


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_the_recipe_runs_on_a_loaded_encoder_decoder_folder(models, recipe, name, tmp_path):
    """``genkit.load_model`` of an encoder-decoder folder returns genkit's adapter, whose forward is
    genkit's protocol: a transformers recipe is given the transformers model inside it (it was given
    the adapter, and transformers' loop failed calling it: a KeyError 'inputs_embeds')."""
    model, x = models[name], S.inputs(name)
    model.save_pretrained(tmp_path)
    loaded = genkit.load_model(tmp_path)
    assert type(loaded).__name__ == "TransformersSeq2SeqAdapter"
    kw = dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=2, max_new_tokens=6, **DICT)
    _assert_same(model, loaded.generate(**x, custom_generate=recipe, **kw), _reference(model, recipe, **x, **kw))


@pytest.mark.parametrize("decoder_prompt", [None, [11, 12], [0, 11, 12]], ids=["start", "prepended", "given"])
def test_a_recipe_without_a_length_counts_20_new_tokens_after_the_decoders_prompt(models, recipe, decoder_prompt):
    """transformers' default length (20 new tokens) counts from the decoder's first tokens; genkit
    counted it from the encoder's input (7 tokens here: 27 decoder tokens instead of 21)."""
    model, x = models["t5"], S.inputs("t5")
    kw = dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.5)
    if decoder_prompt is not None:
        kw["decoder_input_ids"] = torch.tensor([decoder_prompt] * 2)
    ours = genkit.generate(model, **x, custom_generate=recipe, **kw)
    ref = GenerationMixin.generate(model, **x, custom_generate=recipe, trust_remote_code=True, do_sample=False, **kw)
    assert torch.equal(ours, ref)
    assert ours.shape[1] == 20 + (1 if decoder_prompt is None else 3)
