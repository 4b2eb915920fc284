"""Assisted decoding with a draft model against transformers 5 on the same weights: speculative
sampling draws transformers' random numbers in its order (the same tokens for a seed), the draft
policy is read where transformers reads it (the assistant's generation config), and the
``"heuristic"`` schedule carries its count over to the next call, as transformers documents."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import genkit
from genkit.errors import ConfigError

transformers = pytest.importorskip("transformers")

PROMPT = torch.tensor([[1, 5, 9, 33, 70, 12]])


@pytest.fixture(scope="module")
def assistants(tmp_path_factory):
    """(transformers' assistant, genkit's assistant): a 2-layer Qwen2 (vocabulary of ``tiny_pair``)."""
    torch.manual_seed(3)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("assistant")
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(path)
    return transformers.Qwen2ForCausalLM.from_pretrained(path).eval(), genkit.load_model(path)


def _set_policy(models, **policy):
    for m in models:
        for key, value in policy.items():
            setattr(m.generation_config, key, value)


def _run_three(tiny_pair, assistants, seed, monkeypatch, **kw):
    """transformers (its assistant's warpers applied once: tests/assisted_reference.py); genkit on
    the native pair; genkit on transformers' models, from one seed."""
    from assisted_reference import corrected

    (hf, ours), (hf_a, ours_a) = tiny_pair, assistants
    out = []
    for target, assistant, run in ((hf, hf_a, hf.generate), (ours, ours_a, ours.generate),
                                   (hf, hf_a, lambda *a, **k: genkit.generate(hf, *a, **k))):
        _set_policy([assistant], num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
        torch.manual_seed(seed)
        with corrected(monkeypatch) if not out else nullcontext():
            out.append(run(PROMPT, assistant_model=assistant, **kw))
    return out


# (not eos_token_id=None: transformers' assistant then still stops its drafts at its own EOS)
CASES = [
    {"eos_token_id": 2},
    {"eos_token_id": 2, "max_new_tokens": 40},
    {"eos_token_id": [2, 14], "min_new_tokens": 5},
    {"top_k": 5},
    {"repetition_penalty": 1.3},
    # (transformers 5.24's own assistant applies these twice: tests/assisted_reference.py)
    {"temperature": 0.7},
    {"top_p": 0.8, "temperature": 1.2},
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_speculative_sampling_draws_the_tokens_of_transformers(tiny_pair, assistants, monkeypatch, kw, seed):
    """A 4-token draft each round, sampled target: rejections, the residual draw, the bonus token,
    the last round cut by ``max_length`` and a draft that reaches EOS all take transformers' draws."""
    kw = {"max_new_tokens": 20, "do_sample": True, "pad_token_id": 0, **kw}
    ref, native, adapted = _run_three(tiny_pair, assistants, seed, monkeypatch, **kw)
    assert torch.equal(native, ref), (native.tolist(), ref.tolist())
    assert torch.equal(adapted, ref), (adapted.tolist(), ref.tolist())


def test_the_draft_policy_is_read_from_the_assistants_generation_config(tiny_pair, assistants):
    """``assistant_model.generation_config.num_assistant_tokens`` (transformers' place for it) sets
    the draft length; a value passed to ``generate`` for this call wins over it."""
    (_, ours), (_, ours_a) = tiny_pair, assistants
    drafted = []
    from genkit.builtin_strategies import assisted

    real = assisted._draft

    def spy(generator, seqs, room):
        candidates, logits, count = real(generator, seqs, room)
        drafted.append(candidates.shape[1])
        return candidates, logits, count

    assisted._draft = spy
    try:
        _set_policy([ours_a], num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
        ours.generate(PROMPT, assistant_model=ours_a, max_new_tokens=12, eos_token_id=None)
        assert drafted[0] == max(drafted) == 3, drafted  # (fewer where max_length leaves less room)
        drafted.clear()
        ours.generate(PROMPT, assistant_model=ours_a, max_new_tokens=12, eos_token_id=None, num_assistant_tokens=2)
        assert drafted[0] == max(drafted) == 2, drafted
    finally:
        assisted._draft = real
    _set_policy([ours_a], num_assistant_tokens_schedule="sometimes")
    with pytest.raises(ConfigError, match=r"assistant_model.generation_config: `num_assistant_tokens_schedule` must be"):
        ours.generate(PROMPT, assistant_model=ours_a, max_new_tokens=4)


@pytest.mark.parametrize("schedule", ["heuristic", "heuristic_transient"])
def test_heuristic_count_carries_over_to_the_next_call_as_in_transformers(tiny_pair, assistants, schedule):
    """``"heuristic"`` keeps the adapted count in the assistant's generation config for the next
    call; ``"heuristic_transient"`` starts every call from the configured count. Both as transformers."""
    (hf, ours), (hf_a, ours_a) = tiny_pair, assistants
    counts = []
    for target, assistant in ((hf, hf_a), (ours, ours_a)):
        _set_policy([assistant], num_assistant_tokens=5, num_assistant_tokens_schedule=schedule,
                    assistant_confidence_threshold=0.0)
        seen = []
        for _ in range(2):
            target.generate(PROMPT, assistant_model=assistant, max_new_tokens=10, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
            seen.append(assistant.generation_config.num_assistant_tokens)
        counts.append(seen)
    assert counts[1] == counts[0]
    if schedule == "heuristic":
        assert counts[1][0] != 5
    else:
        assert counts[1] == [5, 5]


@pytest.mark.parametrize("kw, message", [
    ({"num_beams": 2}, r"`assistant_model` \(assisted decoding\) works with num_beams=1; got num_beams=2"),
    ({"num_return_sequences": 2, "do_sample": True},
     r"assisted decoding returns one sequence: `num_return_sequences` must be 1; got 2"),
])
def test_what_assisted_decoding_cannot_do_is_named(tiny_pair, assistants, kw, message):
    """transformers drops the assistant under beams (a warning) and refuses ``num_return_sequences``;
    genkit refuses both, naming the setting (not "unexpected model inputs" or a batch size the
    caller never passed)."""
    (hf, ours), (hf_a, ours_a) = tiny_pair, assistants
    for target, assistant in ((ours, ours_a), (hf, hf_a)):
        with pytest.raises(ConfigError, match=message):
            genkit.generate(target, PROMPT, assistant_model=assistant, max_new_tokens=4, **kw)
    with pytest.raises(ConfigError, match=r"`prompt_lookup_num_tokens` works with num_beams=1; got num_beams=2"):
        genkit.generate(ours, PROMPT, prompt_lookup_num_tokens=2, num_beams=2, max_new_tokens=4)
