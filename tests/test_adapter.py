"""genkit.generate on transformers models through the adapter: same tokens as transformers' own."""

from __future__ import annotations

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.models.adapter import TransformersModelAdapter, wrap_transformers_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_models():
    torch.manual_seed(11)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)).eval()
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, initializer_range=0.1)).eval()
    return {"llama": llama, "gpt2": gpt2}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_matches_transformers_generate(hf_models, name):
    hf = hf_models[name]
    ids = torch.tensor([[1, 10, 20, 30, 40]])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=40, min_new_tokens=40)
    assert torch.equal(genkit.generate(hf, ids, max_new_tokens=40, min_new_tokens=40), ref)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padded_batch_matches_transformers_generate(hf_models, name):
    hf = hf_models[name]
    ids = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10], [0, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, min_new_tokens=24)
    out = genkit.generate(hf, ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24)
    assert torch.equal(out, ref)


def test_sampling_with_processors_matches_transformers(hf_models):
    hf = hf_models["llama"]
    ids = torch.tensor([[1, 10, 20, 30, 40]])
    kw = {"do_sample": True, "top_k": 20, "top_p": 0.9, "temperature": 0.7, "max_new_tokens": 20, "min_new_tokens": 20,
              "repetition_penalty": 1.3}
    torch.manual_seed(5)
    ref = hf.generate(ids, **kw)
    torch.manual_seed(5)
    out = genkit.generate(hf, ids, **kw)
    assert torch.equal(out, ref)


def test_adapter_exposes_the_protocol(hf_models):
    hf = hf_models["llama"]
    hf.generation_config.max_length = 31
    model = wrap_transformers_model(hf)
    assert isinstance(model, TransformersModelAdapter) and model._genkit_protocol is True
    assert wrap_transformers_model(model) is model
    assert isinstance(model.generation_config, genkit.GenerationConfig)
    assert model.generation_config.max_length == 31 and model.generation_config.eos_token_id == 2
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.config.vocab_size == 128
    ids = torch.tensor([[1, 5, 6, 7]])
    out = model(ids, output_hidden_states=True, logits_to_keep=1)
    assert out.logits.shape == (1, 1, 128) and len(out.hidden_states) == 3
    # hidden_states[-1] is after the final norm: the head alone gives the logits
    torch.testing.assert_close(hf.lm_head(out.hidden_states[-1][:, -1:]), out.logits, atol=logits_bound(model, ids), rtol=0)
    # lm_head_logits = final norm + head on a pre-norm hidden state
    manual = hf.lm_head(hf.model.norm(out.hidden_states[1]))
    torch.testing.assert_close(model.lm_head_logits(out.hidden_states[1]), manual, atol=logits_bound(model, ids), rtol=0)
    hf.generation_config.max_length = 20


def test_adapter_cache_protocol(hf_models):
    model = wrap_transformers_model(hf_models["llama"])
    ids = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 9, 8, 7, 6, 5]])
    cache = model.new_cache()
    full = model(ids, use_cache=False).logits
    model(ids, past_key_values=cache)
    assert cache.get_seq_length() == 6
    cache.crop(4)  # keep 4 positions (genkit semantics, not transformers' "tokens to remove")
    assert cache.get_seq_length() == 4
    out = model(ids[:, 4:], past_key_values=cache).logits
    torch.testing.assert_close(out, full[:, 4:], atol=logits_bound(model, ids), rtol=0)
    cache.crop(-1)
    assert cache.get_seq_length() == 5
    cache.reorder(torch.tensor([1, 0]))
    step = model(ids[[1, 0], 5:], past_key_values=cache).logits
    torch.testing.assert_close(step[:, -1], full[[1, 0], -1], atol=logits_bound(model, ids), rtol=0)
    cache.select(torch.tensor([0]))
    cache.repeat_interleave(3)
    assert cache.layers[0].keys.shape[0] == 3


def test_generate_method_and_native_passthrough(hf_models, tiny_model):
    model = wrap_transformers_model(hf_models["gpt2"])
    ids = torch.tensor([[1, 10, 20]])
    assert torch.equal(model.generate(ids, max_new_tokens=5, min_new_tokens=5),
                       hf_models["gpt2"].generate(ids, do_sample=False, max_new_tokens=5, min_new_tokens=5))
    with pytest.raises(ValueError, match="must be a transformers PreTrainedModel"):
        wrap_transformers_model(object())


@pytest.mark.parametrize("kw", [{"num_beams": 3}, {"num_beams": 4, "num_return_sequences": 2},
                                {"do_sample": True, "num_return_sequences": 3}], ids=["beams", "beams_nrs", "sample_nrs"])
def test_beam_search_and_expansion_use_the_mapped_cache(hf_models, kw):
    """Beam search reorders the DynamicCache; num_return_sequences expands it."""
    hf = hf_models["llama"]
    ids = torch.tensor([[0, 0, 10, 20, 30], [1, 7, 8, 9, 10]])
    mask = (ids != 0).long()
    torch.manual_seed(0)
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, **kw)
    torch.manual_seed(0)
    out = genkit.generate(hf, ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, **kw)
    assert torch.equal(out, ref)


def test_prompt_lookup_decoding_crops_the_mapped_cache(hf_models):
    hf = hf_models["llama"]
    ids = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8]])
    ref = hf.generate(ids, max_new_tokens=16, prompt_lookup_num_tokens=3)
    assert torch.equal(genkit.generate(hf, ids, max_new_tokens=16, prompt_lookup_num_tokens=3), ref)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_on_a_transformers_model_logs_no_deprecation(hf_models, name):
    """transformers >= 5.24 logs "`past_key_values`/`cache_params` are deprecated" when its outputs'
    cache is read or set under the old name; genkit's generate on a transformers model uses neither
    name on transformers' objects (the adapter returns genkit's output, holding the caller's cache)."""
    import logging

    hf = hf_models[name]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    transformers.utils.logging.warning_once.cache_clear()  # (said once per process otherwise)
    try:
        ids = torch.tensor([[1, 10, 20, 30, 40]])
        out = genkit.generate(hf, ids, max_new_tokens=4, num_beams=2, return_dict_in_generate=True)
        genkit.generate(hf, ids, max_new_tokens=4)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "deprecated" in r.getMessage()] == []
    assert out.cache.get_seq_length() == 8
    step = wrap_transformers_model(hf)(ids)
    assert type(step).__name__ == "CausalLMOutput" and type(step.past_key_values).__name__ == "TransformersCache"
