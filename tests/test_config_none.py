"""``None`` passed to generate for a processor's field turns that processor off, as in
transformers 5 (issue 18, item 1, for the logits-processor fields): the same tokens as transformers
under the same seed (it used to crash with a TypeError)."""

from __future__ import annotations

import pytest
import torch

IDS = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
MASK = (IDS != 0).long()
FIELDS = ["temperature", "top_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
          "encoder_repetition_penalty"]
SET = {"temperature": 0.7, "top_p": 0.8, "typical_p": 0.9, "epsilon_cutoff": 0.01, "eta_cutoff": 0.01,
       "repetition_penalty": 1.3, "encoder_repetition_penalty": 1.2}


@pytest.mark.parametrize("field", FIELDS)
def test_none_turns_the_processor_off_as_in_transformers(tiny_pair, field):
    hf, ours = tiny_pair
    others = {k: v for k, v in SET.items() if k != field and k in ("temperature", "top_p")}
    torch.manual_seed(11)
    ref = hf.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=10, pad_token_id=0,
                      eos_token_id=None, **others, **{field: None})
    torch.manual_seed(11)
    got = ours.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=10, eos_token_id=None,
                        **others, **{field: None})
    assert torch.equal(got, ref)
    # and None is not the same as the set value: with it set, the processor acts
    torch.manual_seed(11)
    with_value = ours.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=10, eos_token_id=None,
                               **others, **{field: SET[field]})
    torch.manual_seed(11)
    ref_value = hf.generate(IDS, attention_mask=MASK, do_sample=True, max_new_tokens=10, pad_token_id=0,
                            eos_token_id=None, **others, **{field: SET[field]})
    assert torch.equal(with_value, ref_value)
