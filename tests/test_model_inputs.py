"""Model inputs forwarded to decoder-only transformers models as transformers' generate does
(inputs_embeds, token_type_ids, pixel_values for GIT), checked against transformers (issue 31)."""

from __future__ import annotations

import pytest
import seq2seq_models as S
import torch

import genkit
from genkit.errors import ConfigError

transformers = pytest.importorskip("transformers")

KW = {"max_new_tokens": 6, "min_new_tokens": 6}


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, initializer_range=0.3)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def git():
    return S.build("git")


IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
TYPES = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])


def _both(model, seed=1, **kw):
    torch.manual_seed(seed)
    ref = model.generate(**kw, **KW)
    torch.manual_seed(seed)
    return genkit.generate(model, **kw, **KW), ref


def test_inputs_embeds_alone_and_with_ids(gpt2):
    embeds = gpt2.get_input_embeddings()(IDS).detach()
    out, ref = _both(gpt2, inputs_embeds=embeds)
    assert torch.equal(out, ref) and out.shape == (2, 6)  # the new tokens only, as in transformers
    out, ref = _both(gpt2, inputs_embeds=embeds * 1.5, input_ids=IDS)  # the embeddings are what the model reads
    assert torch.equal(out, ref) and torch.equal(out[:, :4], IDS)
    assert not torch.equal(out, genkit.generate(gpt2, input_ids=IDS, **KW))


@pytest.mark.parametrize("kw", [{}, {"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}])
def test_token_type_ids_follow_the_tokens(gpt2, kw):
    out, ref = _both(gpt2, input_ids=IDS, token_type_ids=TYPES, **kw)
    assert torch.equal(out, ref)
    torch.manual_seed(1)
    assert not torch.equal(out, genkit.generate(gpt2, input_ids=IDS, **kw, **KW))


@pytest.mark.parametrize("kw", [{}, {"num_beams": 3}, {"do_sample": True, "top_k": 20}])
def test_git_pixel_values_go_to_the_prompt_forward(git, kw):
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    out, ref = _both(git, pixel_values=pixels, input_ids=torch.tensor([[1], [1]]), **kw)
    assert torch.equal(out, ref)
    out, ref = _both(git, pixel_values=pixels, **kw)  # no prompt: BOS per image
    assert torch.equal(out, ref)


def test_a_name_the_forward_does_not_take_is_refused(gpt2):
    with pytest.raises(ConfigError, match="pixel_values"):
        genkit.generate(gpt2, input_ids=IDS, pixel_values=torch.zeros(2, 3, 4, 4), **KW)
    with pytest.raises(ConfigError, match="must cover the same tokens"):
        genkit.generate(gpt2, input_ids=IDS[:, :2], inputs_embeds=torch.zeros(2, 4, 32), **KW)


def test_output_attentions_on_a_native_model(tiny_model):
    """Refused by name while the native forward cannot return attention weights (helper "hfapi"
    adds `output_attentions` to it); once it can, one entry per step."""
    import inspect

    from genkit.errors import NotSupportedError

    ids = torch.tensor([[1, 5, 9]])
    kw = dict(max_new_tokens=3, output_attentions=True, return_dict_in_generate=True)
    if "output_attentions" not in inspect.signature(tiny_model.forward).parameters:
        with pytest.raises(NotSupportedError, match="`output_attentions=True` is not supported by LlamaForCausalLM"):
            genkit.generate(tiny_model, ids, **kw)
        return
    out = genkit.generate(tiny_model, ids, **kw)
    assert len(out.attentions) == 3 and out.attentions[0][0].shape[-1] == 3


def test_native_model_takes_inputs_embeds_and_logits_to_keep(tiny_pair):
    """genkit's native Llama gets `inputs_embeds` and `logits_to_keep` from generate as transformers'
    Llama of the same weights does: the same tokens (the new ones only from embeddings alone)."""
    hf, ours = tiny_pair
    ids = torch.tensor([[1, 17, 42, 7], [1, 99, 3, 64]])
    embeds = hf.get_input_embeddings()(ids).detach() * 1.5
    for kw in ({"inputs_embeds": embeds}, {"inputs_embeds": embeds, "input_ids": ids}, {"num_beams": 2, "inputs_embeds": embeds},
               {"input_ids": ids, "logits_to_keep": 0}, {"input_ids": ids, "logits_to_keep": 3}):
        out, ref = genkit.generate(ours, **kw, **KW), hf.generate(**kw, **KW)
        assert torch.equal(out, ref), kw
    assert genkit.generate(ours, inputs_embeds=embeds, **KW).shape == (2, 6)
    assert not torch.equal(genkit.generate(ours, inputs_embeds=embeds, **KW),
                           genkit.generate(ours, input_ids=ids, **KW)[:, 4:])


def test_native_model_refuses_other_forward_arguments_by_name(tiny_model):
    from genkit.errors import NotSupportedError

    ids = torch.tensor([[1, 5, 9]])
    with pytest.raises(NotSupportedError, match=r"\['labels'\] are forwarded to transformers models only.*"
                                                r"inputs_embeds, logits_to_keep"):
        genkit.generate(tiny_model, ids, labels=ids, **KW)
    for bad in (-1, 1.5, True, "all"):
        with pytest.raises(ConfigError, match="`logits_to_keep` must be an int >= 0"):
            genkit.generate(tiny_model, ids, logits_to_keep=bad, **KW)
