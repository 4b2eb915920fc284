"""Self-speculative early exit (``assistant_early_exit``): the first layers draft into the model's own
cache, the whole model verifies. Under greedy decoding the tokens are greedy decoding's and
transformers 5's ``assistant_early_exit`` on the same weights; the number of full-model passes
(logged) is transformers 5's too, counted there with a hook on the last decoder layer."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.strategy import Stepper, StopConditions, StrategyCall

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 17, 42, 5, 60, 33, 8], [1, 9, 88, 4], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers 5 model, genkit model) with the same weights: a 4-layer Llama whose last two
    layers are damped, so that its first two layers draft well but not perfectly."""
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(hf.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape, generator=gen))
        for layer in hf.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.15)
            layer.mlp.down_proj.weight.mul_(0.15)
    path = tmp_path_factory.mktemp("early_exit")
    hf.save_pretrained(path)
    return hf, genkit.load_model(path)


def _transformers_run(hf: Any, ids: torch.Tensor, exit_layer: int, policy: dict[str, Any],
                      **kwargs: Any) -> tuple[list[list[int]], int]:
    """transformers 5's early exit; the draft policy is read from the model's generation config
    there (the model is its own assistant). Returns (tokens, full-model passes)."""
    passes = []
    handle = hf.model.layers[-1].register_forward_hook(lambda *a: passes.append(1))
    saved = hf.generation_config
    hf.generation_config = transformers.GenerationConfig(**{**saved.to_dict(), **policy})
    try:
        out = hf.generate(ids, assistant_early_exit=exit_layer, do_sample=False, **kwargs)
    finally:
        hf.generation_config = saved
        handle.remove()
    return out.tolist(), len(passes)


def _genkit_run(model: Any, ids: torch.Tensor, caplog: Any, **kwargs: Any) -> tuple[list[list[int]], dict[str, int]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="genkit.early_exit"):
        out = genkit.generate(model, ids, **kwargs)
    records = [r for r in caplog.records if r.name == "genkit.early_exit"]
    assert len(records) == 1
    return out.tolist(), records[0].early_exit


POLICIES = [
    {},  # transformers' defaults: 20 tokens, confidence threshold 0.4
    {"assistant_confidence_threshold": 0.0},
    {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0},
]


@pytest.mark.parametrize("policy", POLICIES, ids=["defaults", "no-threshold", "heuristic"])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_same_tokens_and_passes_as_transformers_5(pair, caplog, policy, exit_layer):
    hf, ours = pair
    ids = torch.tensor([PROMPTS[0]])
    ref, ref_passes = _transformers_run(hf, ids, exit_layer, policy, max_new_tokens=30, eos_token_id=None)
    tokens, stats = _genkit_run(ours, ids, caplog, max_new_tokens=30, eos_token_id=None,
                                assistant_early_exit=exit_layer, **policy)
    assert tokens == ref
    assert tokens == genkit.generate(ours, ids, max_new_tokens=30, eos_token_id=None).tolist()
    assert stats["full_passes"] == ref_passes
    assert stats["new_tokens"] == 30 and stats["exit_layer"] == exit_layer
    assert stats["accepted"] <= stats["drafted"]
    # each full pass yields the accepted drafts plus one token of the model's own
    assert stats["accepted"] + stats["full_passes"] == 30


def test_passes_count_what_is_saved(pair, caplog, tmp_path):
    """A draft that the whole model always agrees with (the layers after the exit do nothing) is
    accepted whole: 30 tokens take 2 full passes (20 drafts + 1, then the 8 that fit + 1); greedy
    decoding takes 30."""
    hf, ours = pair
    model = genkit.load_model(_damped_copy(hf, factor=0.0, path=tmp_path))
    ids = torch.tensor([PROMPTS[1]])
    tokens, stats = _genkit_run(model, ids, caplog, max_new_tokens=30, eos_token_id=None, assistant_early_exit=2,
                                assistant_confidence_threshold=0.0)
    assert tokens == genkit.generate(model, ids, max_new_tokens=30, eos_token_id=None).tolist()
    assert stats == {"exit_layer": 2, "new_tokens": 30, "full_passes": 2, "drafted": 28, "accepted": 28}


def _damped_copy(hf: Any, factor: float, path: Any) -> Any:
    import copy

    clone = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in clone.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)
    clone.save_pretrained(path)
    return path


@pytest.mark.parametrize("prompt", PROMPTS)
def test_equals_greedy_with_eos_and_min_tokens(pair, caplog, prompt):
    _, ours = pair
    ids = torch.tensor([prompt])
    for extra in ({"eos_token_id": 5}, {"eos_token_id": 5, "min_new_tokens": 6}, {"repetition_penalty": 1.3}):
        greedy = genkit.generate(ours, ids, max_new_tokens=25, **extra).tolist()
        tokens, stats = _genkit_run(ours, ids, caplog, max_new_tokens=25, assistant_early_exit=2, **extra)
        assert tokens == greedy, extra
        assert stats["new_tokens"] == len(greedy[0]) - len(prompt)


def test_outputs_and_registry(pair):
    _, ours = pair
    ids = torch.tensor([PROMPTS[0]])
    config = genkit.GenerationConfig(assistant_early_exit=2)
    assert config.get_generation_mode() == genkit.GenerationMode.ASSISTED_GENERATION  # as transformers reports it
    assert config.strategy_name() == "assisted_early_exit"
    out = genkit.generate(ours, ids, max_new_tokens=12, eos_token_id=None, assistant_early_exit=2,
                          return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = genkit.generate(ours, ids, max_new_tokens=12, eos_token_id=None, return_dict_in_generate=True,
                            output_scores=True, output_logits=True)
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(out.logits) == 12
    atol = logits_bound(ours, out.sequences)  # the same logits, computed in other orders (drafts, then checks)
    for a, b in zip(out.scores, plain.scores):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)
    assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
    named = genkit.generate(ours, ids, max_new_tokens=12, eos_token_id=None, assistant_early_exit=2,
                            custom_generate="assisted_early_exit")
    assert torch.equal(named, plain.sequences)


def test_sampling_keeps_lengths_and_draws_from_the_model(pair):
    _, ours = pair
    ids = torch.tensor([PROMPTS[0]])
    torch.manual_seed(0)
    out = genkit.generate(ours, ids, max_new_tokens=20, eos_token_id=None, assistant_early_exit=2, do_sample=True)
    assert out.shape == (1, len(PROMPTS[0]) + 20)
    assert torch.equal(out[:, :len(PROMPTS[0])], ids)


def test_draft_shares_the_model_cache(pair):
    """Stepper: a partial-depth step writes the first layers of the same cache; a full forward then
    runs the positions the deep layers lack, and its logits are a plain full forward's."""
    _, ours = pair
    ids = torch.tensor([PROMPTS[2]])
    config = genkit.GenerationConfig(max_new_tokens=8)
    call = StrategyCall(model=ours, input_ids=ids, config=config, logits_processor=lambda _i, s: s,
                        stop=StopConditions(max_length=ids.shape[1] + 8))
    stepper = Stepper(call)
    stepper.prefill(num_layers=2)
    cache = stepper.cache
    assert [cache.get_seq_length(i) for i in range(4)] == [10, 10, 0, 0]
    stepper.step(torch.tensor([7]), num_layers=2)
    stepper.push(torch.tensor([8]))
    assert [cache.get_seq_length(i) for i in range(4)] == [11, 11, 0, 0]
    logits = stepper.forward(keep=3)
    assert stepper.cache is cache and [cache.get_seq_length(i) for i in range(4)] == [12] * 4
    full = ours(stepper.sequences).logits[:, -3:]
    torch.testing.assert_close(logits, full, atol=logits_bound(ours, stepper.sequences), rtol=0)
    stepper.crop(11)
    assert [cache.get_seq_length(i) for i in range(4)] == [11] * 4


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [4, 5, 0])
def test_exit_layer_must_be_below_the_layer_count(pair, value):
    _, ours = pair
    kind = ConfigError
    match = r"`assistant_early_exit` must be a layer count from 1 to 3 \(the model has 4 layers"
    if value == 0:
        match = r"`assistant_early_exit` must be a layer index >= 1 or None; got 0"
    with pytest.raises(kind, match=match):
        genkit.generate(ours, torch.tensor([PROMPTS[0]]), max_new_tokens=3, assistant_early_exit=value)


def test_batches_and_models_without_partial_depth_are_refused(pair, tiny_pair):
    _, ours = pair
    with pytest.raises(ConfigError, match="early-exit decoding supports batch size 1"):
        genkit.generate(ours, torch.tensor([PROMPTS[0], PROMPTS[0]]), max_new_tokens=3, assistant_early_exit=2)
    with pytest.raises(ConfigError, match=r"unexpected model inputs for early-exit decoding: \['assistant_model'\]"):
        genkit.generate(ours, torch.tensor([PROMPTS[0]]), max_new_tokens=3, assistant_early_exit=2,
                        assistant_model=ours)
    hf_model, _ = tiny_pair  # a transformers model through the adapter: no partial-depth forward
    with pytest.raises(ConfigError, match=r"`assistant_early_exit` needs a model whose forward can stop"):
        genkit.generate(hf_model, torch.tensor([[1, 5, 6]]), max_new_tokens=3, assistant_early_exit=1)
    with pytest.raises(NotSupportedError, match="does not support partial depth"):
        from genkit.models.base import GenkitModel

        class Whole(type(ours)):  # type: ignore[misc, valid-type]
            supports_partial_depth = False

        model = Whole(ours.config)
        GenkitModel.forward(model, torch.tensor([[1, 2]]), num_layers=1)
