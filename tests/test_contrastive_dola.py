"""Contrastive search and DoLa against transformers 4.55's native implementations.

The references (``tests/fixtures/strategy_refs.json``) were generated once by
``tests/fixtures/make_strategy_refs.py`` with transformers 4.55.4 on the saved random Llamas in
``tests/fixtures/strategy_models/`` (tied and untied embeddings, 8 and 4 layers): batch 1 and a
left-padded batch of 3, ``"low"``, ``"high"`` and lists of layers, with and without a repetition
penalty, ``low_memory`` on and off, and seeded DoLa sampling. Tokens must match exactly.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from tolerance import hidden_bound, logits_bound

import genkit
from genkit.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
REFS = json.loads((FIXTURES / "strategy_refs.json").read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in REFS["cases"]}


@cache
def load(name: str) -> Any:
    return genkit.load_model(FIXTURES / "strategy_models" / name)


def _generate(case: dict[str, Any], **overrides: Any) -> Any:
    kwargs = {**case["kwargs"], **overrides}
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    return genkit.generate(load(case["model"]), torch.tensor(case["prompt"]),
                           attention_mask=torch.tensor(case["attention_mask"]), max_new_tokens=16, pad_token_id=0,
                           eos_token_id=2, **kwargs)


def _sequences(out: Any) -> list[list[int]]:
    return (out.sequences if hasattr(out, "sequences") else out).tolist()


def test_fixture_covers_what_the_issue_lists():
    names = set(CASES)
    assert REFS["meta"]["transformers"].startswith("4.")
    for strategy in ("contrastive", "dola"):
        for part in ("llama8_untied", "llama8_tied", "-b1", "-b3", "-rep"):
            assert any(n.startswith(strategy) and part in n for n in names), (strategy, part)
    assert {"dola-llama8_tied-b3-low", "dola-llama8_tied-b3-high", "dola-llama8_tied-b3-1-3-5"} <= names
    assert any(c["kwargs"].get("low_memory") for c in REFS["cases"])
    # sequences that finish early (EOS, then padding) are covered too
    assert any(2 in row[len(c["prompt"][0]):] for c in REFS["cases"] for row in c["sequences"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_tokens_as_transformers_4(name):
    case = CASES[name]
    assert _sequences(_generate(case)) == case["sequences"]


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.startswith("contrastive") and "-b3" in n))
def test_low_memory_gives_the_same_batched_tokens(name):
    # transformers 4.55 fails on batches with low_memory=True; the batched references are its
    # low_memory=False output, which genkit's low-memory mode must reproduce
    assert _sequences(_generate(CASES[name], low_memory=True)) == CASES[name]["sequences"]


@pytest.mark.parametrize("name", ["contrastive-llama8_untied-b1-scores", "dola-llama8_untied-b1-scores"])
def test_scores_and_logits_match(name):
    case = CASES[name]
    out = _generate(case)
    assert out.sequences.tolist() == case["sequences"]
    # transformers' logits are the same function in another order; DoLa's scores are the difference
    # of two log-softmaxes, each moving an entry by at most twice the largest logit error
    atol = 4 * logits_bound(load(case["model"]), out.sequences)
    for mine, ref in ((out.scores, case["scores"]), (out.logits, case["logits"])):
        assert len(mine) == len(ref)
        for step, expected in zip(mine, ref):
            torch.testing.assert_close(step, torch.tensor(expected), atol=atol, rtol=0)


def test_hidden_states_are_those_of_the_chosen_tokens():
    case = CASES["contrastive-llama8_untied-b3"]
    full = _generate(case, return_dict_in_generate=True, output_hidden_states=True)
    low = _generate(case, return_dict_in_generate=True, output_hidden_states=True, low_memory=True)
    layers = 8 + 1
    assert len(full.hidden_states) == 16 and len(full.hidden_states[0]) == layers
    assert full.hidden_states[0][0].shape == (3, 7, 16)  # the prompt's, then one position per step
    assert full.hidden_states[1][-1].shape == (3, 1, 16)
    # the same tokens through batches of 12 and of 3 rows: float32 products blocked differently
    assert full.sequences.tolist() == low.sequences.tolist()
    config, length = load(case["model"]).config, full.sequences.shape[1]
    for a, b in zip(full.hidden_states[1:], low.hidden_states[1:]):
        for depth, (x, y) in enumerate(zip(a, b)):
            torch.testing.assert_close(x, y, atol=hidden_bound(config, length, depth, x), rtol=0)


@pytest.mark.parametrize(("name", "strategy"), [("contrastive-llama8_tied-b1", "contrastive_search"),
                                                ("dola-llama8_tied-b3-high", "dola_generation")])
def test_selected_by_the_registry_and_usable_by_name(name, strategy):
    case = CASES[name]
    config = genkit.GenerationConfig(**case["kwargs"])
    assert config.get_generation_mode() == strategy
    assert _sequences(_generate(case, custom_generate=strategy)) == case["sequences"]


def test_returned_cache_continues_like_greedy():
    """The returned cache holds every token but the last (as after greedy search)."""
    case = CASES["contrastive-llama8_untied-b3"]
    for low_memory in (False, True):
        out = _generate(case, return_dict_in_generate=True, low_memory=low_memory)
        assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1
        assert out.past_key_values.keys[0].shape[0] == 3
    out = _generate(CASES["contrastive-llama8_untied-b1"], return_dict_in_generate=True)
    model = load("llama8_untied")
    step = model(out.sequences[:, -1:], past_key_values=out.past_key_values)
    whole = model(out.sequences)
    torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], atol=logits_bound(model, out.sequences), rtol=0)


def test_streamer_receives_the_chosen_tokens():
    class Recorder:
        def __init__(self) -> None:
            self.puts: list[list[int]] = []

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.flatten().tolist())

        def end(self) -> None:
            self.puts.append([-1])

    case = CASES["contrastive-llama8_tied-b1"]
    recorder = Recorder()
    out = _sequences(_generate(case, streamer=recorder))[0]
    assert recorder.puts[0] == case["prompt"][0] and recorder.puts[-1] == [-1]
    assert [t for put in recorder.puts[1:-1] for t in put] == out[len(case["prompt"][0]):]


# -- bad input -------------------------------------------------------------------------------
def _tiny() -> Any:
    return load("llama8_untied")


@pytest.mark.parametrize("alpha", [-0.1, 1.5, "0.6"])
def test_penalty_alpha_outside_zero_one(alpha):
    with pytest.raises(ConfigError, match=r"`penalty_alpha` must be a number in \[0, 1\] or None; got"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, penalty_alpha=alpha, top_k=4)


@pytest.mark.parametrize("top_k", [0, 1])
def test_penalty_alpha_without_top_k_above_one(top_k):
    with pytest.raises(ConfigError, match=rf"`penalty_alpha` > 0 \(contrastive search\) needs `top_k` > 1 .*"
                                          rf"top_k={top_k}"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, penalty_alpha=0.6, top_k=top_k)


def test_penalty_alpha_with_sampling_or_beams_is_refused():
    for extra in ({"do_sample": True}, {"num_beams": 2}):
        with pytest.raises(ConfigError, match="needs do_sample=False and num_beams=1"):
            genkit.GenerationConfig(penalty_alpha=0.6, top_k=4, **extra)


def test_penalty_alpha_zero_is_greedy_search():
    ids = torch.tensor([[1, 2, 3]])
    assert genkit.GenerationConfig(penalty_alpha=0.0, top_k=4).get_generation_mode() == "greedy_search"
    assert torch.equal(genkit.generate(_tiny(), ids, max_new_tokens=5, penalty_alpha=0.0),
                       genkit.generate(_tiny(), ids, max_new_tokens=5))


def test_low_memory_without_contrastive_search_is_refused():
    with pytest.raises(ConfigError, match=r"`low_memory=True` only changes contrastive search"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, low_memory=True)


@pytest.mark.parametrize("layers", [[9], [3, 8], [-1], []])
def test_dola_layers_naming_a_layer_that_does_not_exist(layers):
    with pytest.raises(ConfigError, match=r"`dola_layers` .*this model has 8 layers, so premature layers are 0 "
                                          r"\(the word embeddings\) to 7"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, dola_layers=layers)


def test_dola_layers_of_the_wrong_type():
    with pytest.raises(ConfigError, match=r'`dola_layers` must be "low", "high", a list of layer indices, or None'):
        genkit.GenerationConfig(dola_layers="middle")


def test_layer_strategies_do_not_combine():
    with pytest.raises(ConfigError, match="`penalty_alpha` and `dola_layers` select different strategies"):
        genkit.GenerationConfig(penalty_alpha=0.6, top_k=4, dola_layers="high")
    with pytest.raises(ConfigError, match="`dola_layers` and `prompt_lookup_num_tokens` select different"):
        genkit.GenerationConfig(dola_layers="low", prompt_lookup_num_tokens=3)
    with pytest.raises(ConfigError, match="`dola_layers` works with num_beams=1"):
        genkit.GenerationConfig(dola_layers="low", num_beams=2)
    # an assistant model with them is refused by the strategy, not silently dropped
    with pytest.raises(ConfigError, match=r"unexpected model inputs for DoLa decoding: \['assistant_model'\]"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, dola_layers="low",
                        assistant_model=load("llama8_tied"))


def test_contrastive_search_needs_the_cache():
    with pytest.raises(ConfigError, match=r"`use_cache` must be True \(or unset\) with `penalty_alpha`"):
        genkit.generate(_tiny(), torch.tensor([[1, 2, 3]]), max_new_tokens=2, penalty_alpha=0.6, top_k=4,
                        use_cache=False)


def test_dola_without_cache_gives_the_same_tokens():
    case = CASES["dola-llama8_untied-b3-1-3-5"]
    assert _sequences(_generate(case, use_cache=False)) == case["sequences"]


def test_contrastive_search_does_not_warn_that_top_k_needs_sampling(caplog):
    """top_k is contrastive search's number of candidates, not a sampling knob (no warning, as in
    transformers); without penalty_alpha the same call warns."""
    import logging

    ids = torch.tensor([[1, 2, 3]])
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        genkit.generate(_tiny(), ids, max_new_tokens=3, penalty_alpha=0.6, top_k=4)
    assert not [r for r in caplog.records if "`top_k`" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        genkit.generate(_tiny(), ids, max_new_tokens=3, top_k=4)
    assert [r for r in caplog.records if "`top_k` is set to 4 but `do_sample` is not True" in r.getMessage()]


@pytest.mark.parametrize("low_memory", [False, True])
def test_contrastive_search_records_attentions(tiny_model, low_memory):
    """output_attentions=True: one tuple of layer weights per step, the chosen token's (the prompt's
    at the first step), equal to those of one forward over the final sequence."""
    ids = torch.tensor([[1, 5, 9, 11], [1, 7, 3, 20]])
    out = genkit.generate(tiny_model, ids, max_new_tokens=4, penalty_alpha=0.6, top_k=4, low_memory=low_memory,
                          output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, genkit.generate(tiny_model, ids, max_new_tokens=4, penalty_alpha=0.6, top_k=4,
                                                      low_memory=low_memory))
    with torch.no_grad():
        full = tiny_model(out.sequences, output_attentions=True).attentions
    assert len(out.attentions) == 4
    for step, layers in enumerate(out.attentions):
        rows = slice(0, 4) if step == 0 else slice(3 + step, 4 + step)  # the queries of that forward
        for got, want in zip(layers, full, strict=True):
            torch.testing.assert_close(got, want[:, :, rows, :got.shape[-1]], rtol=1e-4, atol=1e-5)


def test_dola_records_attentions(tiny_model):
    ids = torch.tensor([[1, 5, 9, 11]])
    out = genkit.generate(tiny_model, ids, max_new_tokens=3, dola_layers="low", output_attentions=True,
                          return_dict_in_generate=True)
    with torch.no_grad():
        full = tiny_model(out.sequences, output_attentions=True).attentions
    for step, layers in enumerate(out.attentions):
        rows = slice(0, 4) if step == 0 else slice(3 + step, 4 + step)
        for got, want in zip(layers, full, strict=True):
            torch.testing.assert_close(got, want[:, :, rows, :got.shape[-1]], rtol=1e-4, atol=1e-5)
