"""First end-to-end checks of the core loop against transformers on the same weights."""

from __future__ import annotations

import torch

import genkit


def test_greedy_matches_transformers_batch1_and_padded(tiny_pair):
    hf, ours = tiny_pair
    ids = torch.tensor([[1, 10, 20, 30, 40]])
    assert torch.equal(hf.generate(ids, do_sample=False, max_new_tokens=24),
                       genkit.generate(ours, ids, max_new_tokens=24))
    ids3 = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
    mask = (ids3 != 0).long()
    ref = hf.generate(ids3, attention_mask=mask, do_sample=False, max_new_tokens=24)
    out = ours.generate(ids3, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(ref, out)


def test_default_max_length_is_20_new_tokens(tiny_model):
    assert tiny_model.generation_config.max_length is None  # unset: transformers 5's default applies
    out = tiny_model.generate(torch.tensor([[1, 2, 3]]), eos_token_id=None)
    assert out.shape == (1, 3 + 20)
