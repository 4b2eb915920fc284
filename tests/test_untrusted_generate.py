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
    out = genkit.generate(tiny_model, ids, max_new_tokens=context - 3, min_new_tokens=context - 3)
    assert out.shape == (1, context)  # the whole context stays usable


# -- hostile generation settings: refused by name before anything is allocated --------------------
def test_a_sampling_temperature_too_small_to_scale_by_is_refused(tiny_model):
    """temperature=1e-320 divided the logits into inf, then sampling failed on NaN probabilities (a
    RuntimeError); vLLM reads a temperature under 1e-5 as greedy: here it is a ConfigError."""
    ids = torch.tensor([[1, 2, 3]])
    for t in (1e-320, 9.99e-6):
        with pytest.raises(ConfigError) as exc:
            genkit.generate(tiny_model, ids, max_new_tokens=3, do_sample=True, temperature=t)
        assert str(exc.value) == (f"`temperature` must be >= 1e-05 when do_sample=True; got {t!r}: a smaller one "
                                  "overflows the scaled logits. For greedy decoding set do_sample=False.")
    genkit.set_seed(0)
    out = genkit.generate(tiny_model, ids, max_new_tokens=3, do_sample=True, temperature=1e-5)
    assert out.tolist() == genkit.generate(tiny_model, ids, max_new_tokens=3).tolist()  # as good as greedy


def test_huge_length_penalties_score_beams_without_overflow(tiny_model):
    """length_penalty=1e308 made beam search's `length ** length_penalty` an OverflowError; the
    divisor is kept in float32's range, so 1e308 ranks as 1000 does (both past it), -1e308 as -1000;
    a value that is no finite number is refused when set."""
    from genkit.builtin_strategies.beam_common import length_normalizer

    assert length_normalizer(7, 1.5) == 7.0 ** 1.5 and length_normalizer(1, 1e308) == 1.0
    assert length_normalizer(2, 1e308) == length_normalizer(2, 1000) == 3.4028234663852886e38
    assert length_normalizer(2, -1e308) == length_normalizer(2, -1000) == 1.1754943508222875e-38
    ids = torch.tensor([[1, 2, 3], [1, 4, 5]])
    for strategy in ({"num_beams": 3}, {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
                     {"num_beams": 3, "force_words_ids": [[7]]}):
        for big, moderate in ((1e308, 1000.0), (-1e308, -1000.0)):
            got = genkit.generate(tiny_model, ids, max_new_tokens=4, length_penalty=big, eos_token_id=9, **strategy)
            want = genkit.generate(tiny_model, ids, max_new_tokens=4, length_penalty=moderate, eos_token_id=9,
                                   **strategy)
            assert got.tolist() == want.tolist()
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"^`length_penalty` must be a finite number \(exponent on the sequence "
                                              r"length\); got (inf|nan)\.$"):
            genkit.GenerationConfig(length_penalty=bad)
