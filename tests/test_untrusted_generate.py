"""issue 28, inputs to generate: token ids outside the vocabulary, unknown forward keyword
arguments and a device this torch build lacks are clear errors, not IndexError, silent acceptance
or an AssertionError."""

from __future__ import annotations

import json

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import TINY_LLAMA


@pytest.mark.parametrize("bad", [99999, 128, -1])
def test_token_ids_outside_the_vocabulary_are_a_config_error(tiny_model, bad):
    with pytest.raises(ConfigError, match=rf"`input_ids` holds token ids \[{bad}\] outside the model's vocabulary "
                                          r"\(size 128\); accepted ids are 0..127; check the tokenizer"):
        genkit.generate(tiny_model, torch.tensor([[1, bad]]), max_new_tokens=2)
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        tiny_model(torch.tensor([[bad, 1]]))


def test_unknown_forward_keywords_are_refused_by_name(tiny_model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ConfigError, match=r"unknown keyword argument\(s\) 'foo' for the model's forward"):
        tiny_model(ids, foo=1)
    with pytest.raises(ConfigError, match=r"`labels` must have the shape of `input_ids` \(1, 3\)"):
        tiny_model(ids, labels=ids[:, :2])
    want = tiny_model(ids).logits
    assert torch.equal(tiny_model(ids, return_dict=True, output_attentions=False).logits, want)


def test_a_device_this_torch_lacks_is_a_config_error(tmp_path):
    from safetensors.torch import save_file

    from genkit.models.tiny import tiny_llama
    save_file({k: v.contiguous() for k, v in tiny_llama().state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(ConfigError, match=r"`device`='nonsense' is not a torch device"):
        genkit.load_model(tmp_path, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"`device`='cuda': (this torch build has no CUDA support|no cuda device)"):
            genkit.load_model(tmp_path, device="cuda")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ConfigError, match=rf"there are {n} cuda device"):
            genkit.load_model(tmp_path, device=f"cuda:{n}")
    assert genkit.load_model(tmp_path, device="cpu").device.type == "cpu"



def test_a_length_past_the_context_is_refused_before_anything_is_allocated(tiny_model):
    """max_new_tokens=10**9 used to size an (rows, 10**9) id buffer (8 GB) before max_time could stop it."""
    context = tiny_model.config.max_position_embeddings
    ids = torch.tensor([[1, 2, 3]])
    for engine in ({}, {"num_beams": 2}, {"penalty_alpha": 0.6, "top_k": 4}):
        with pytest.raises(ConfigError, match=rf"`max_new_tokens` \(1000000000\) with a prompt of 3 tokens needs "
                                              rf"1000000003 positions; the model's context \(`max_position_embeddings`\) "
                                              rf"is {context}: ask for at most {context - 3} new tokens"):
            genkit.generate(tiny_model, ids, max_new_tokens=10**9, max_time=3, **engine)
    with pytest.raises(ConfigError, match=rf"^`max_length` \({context + 1}\) with a prompt of 3 tokens is past the context; "
                                          rf"the model's "
                                          rf"context \(`max_position_embeddings`\) is {context}: ask for at most "):
        genkit.generate(tiny_model, ids, max_length=context + 1)  # named as the caller set it
    with pytest.raises(ConfigError, match=rf"^the prompt has {context} tokens; the model's context "
                                          rf"\(`max_position_embeddings`\) is {context}: shorten the prompt to at most "
                                          rf"{context - 1} tokens"):  # (not "ask for at most 0 new tokens")
        genkit.generate(tiny_model, torch.ones(1, context, dtype=torch.long), max_new_tokens=3)
    out = genkit.generate(tiny_model, ids, max_new_tokens=context - 3, min_new_tokens=context - 3)
    assert out.shape == (1, context)  # the whole context stays usable
