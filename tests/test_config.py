"""GenerationConfig: validation (>= 30 invalid combinations, through the config and through
generate), generation_config.json round trips with transformers, update/repr/eq/dicts."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import genkit
from genkit import GenerationConfig

transformers = pytest.importorskip("transformers")

# (kwargs, field named in the message, a fragment of the accepted values in the message)
INVALID = [
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": float("nan")}, "top_p", "(0, 1]"),
    ({"temperature": 0, "do_sample": True}, "temperature", "> 0"),
    ({"temperature": -1.0}, "temperature", ">= 0"),
    ({"temperature": float("inf"), "do_sample": True}, "temperature", "finite"),
    ({"max_new_tokens": -1}, "max_new_tokens", ">= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    ({"max_new_tokens": True}, "max_new_tokens", "an int"),
    # equal to the default, but not an int count: True == 1, 20.0 == 20, False == 0
    ({"num_return_sequences": True}, "num_return_sequences", "an int >= 1"),
    ({"num_beams": True}, "num_beams", "an int >= 1"),
    ({"max_length": 20.0}, "max_length", "an int >= 1"),
    ({"min_length": False}, "min_length", "an int >= 0"),
    ({"max_length": 0}, "max_length", ">= 1"),
    ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens", "<= `max_new_tokens`"),
    ({"min_length": 30, "max_length": 20}, "min_length", "<= `max_length`"),
    ({"min_new_tokens": -1}, "min_new_tokens", ">= 0"),
    ({"num_return_sequences": 2}, "num_return_sequences", "do_sample=True or num_beams > 1"),
    ({"num_return_sequences": 0}, "num_return_sequences", ">= 1"),
    ({"num_return_sequences": 5, "num_beams": 2}, "num_return_sequences", "<= `num_beams`"),
    ({"bad_words_ids": [[-1]]}, "bad_words_ids", "token ids >= 0"),
    ({"bad_words_ids": []}, "bad_words_ids", "non-empty list"),
    ({"bad_words_ids": [[1, 2], []]}, "bad_words_ids", "non-empty lists"),
    ({"top_k": -1}, "top_k", ">= 0"),
    ({"top_k": 2.5}, "top_k", "an int"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "> 0"),
    ({"encoder_repetition_penalty": 0}, "encoder_repetition_penalty", "> 0"),
    ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size", ">= 0"),
    ({"typical_p": 0}, "typical_p", "(0, 1]"),
    ({"epsilon_cutoff": 1.0}, "epsilon_cutoff", "[0, 1)"),
    ({"eta_cutoff": -0.1}, "eta_cutoff", "[0, 1)"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"top_h": 0}, "top_h", "(0, 1]"),
    ({"num_beams": 0}, "num_beams", ">= 1"),
    ({"num_beams": 3, "num_beam_groups": 2}, "num_beams", "divisible by `num_beam_groups`"),
    ({"num_beam_groups": 2, "num_beams": 2, "do_sample": True}, "num_beam_groups", "do_sample=False"),
    ({"eos_token_id": 2.5}, "eos_token_id", "token id >= 0"),
    ({"eos_token_id": []}, "eos_token_id", "non-empty list of ids"),
    ({"pad_token_id": "0"}, "pad_token_id", "token id >= 0"),
    ({"bos_token_id": -1}, "bos_token_id", "token id >= 0"),
    ({"decoder_start_token_id": -1}, "decoder_start_token_id", "token id >= 0"),
    ({"forced_bos_token_id": -1}, "forced_bos_token_id", "token id >= 0"),
    ({"forced_eos_token_id": []}, "forced_eos_token_id", "a list of ids"),
    ({"do_sample": "yes"}, "do_sample", "True or False"),
    ({"output_scores": 1}, "output_scores", "True or False"),
    ({"renormalize_logits": "yes"}, "renormalize_logits", "True or False"),
    ({"max_time": 0}, "max_time", "> 0"),
    ({"stop_strings": ""}, "stop_strings", "non-empty string"),
    ({"stop_strings": [1]}, "stop_strings", "list of non-empty strings"),
    ({"suppress_tokens": [-1]}, "suppress_tokens", "token ids >= 0"),
    ({"suppress_tokens": 5}, "suppress_tokens", "a list of token ids"),
    ({"begin_suppress_tokens": []}, "begin_suppress_tokens", "a list of token ids"),
    ({"exponential_decay_length_penalty": (5, 0.5)}, "exponential_decay_length_penalty", "decay_factor"),
    ({"sequence_bias": {(1,): "a"}}, "sequence_bias", "bias"),
    ({"sequence_bias": {}}, "sequence_bias", "non-empty dict"),
    ({"cache_implementation": "foo"}, "cache_implementation", '"dynamic", "static"'),
    ({"early_stopping": "sometimes"}, "early_stopping", '"never"'),
]


def _check(err: pytest.ExceptionInfo, field: str, accepted: str) -> None:
    msg = str(err.value)
    assert f"`{field}`" in msg, msg
    assert accepted in msg, msg


def test_there_are_at_least_30_invalid_cases():
    assert len(INVALID) >= 30


@pytest.mark.parametrize(("kw", "field", "accepted"), INVALID, ids=[str(c[0]) for c in INVALID])
def test_invalid_config_raises_naming_field_and_accepted_values(kw, field, accepted):
    with pytest.raises(ValueError) as err:
        GenerationConfig(**kw)
    _check(err, field, accepted)


# misspelt keywords: generate refuses them naming the closest field (a GenerationConfig keeps them as
# custom entries, as transformers does: see test_config_semantics.py)
TYPOS = [
    ({"max_new_token": 5}, "max_new_token", "max_new_tokens"),
    ({"temprature": 0.5}, "temprature", "temperature"),
]


@pytest.mark.parametrize(("kw", "field", "accepted"), INVALID + TYPOS, ids=[str(c[0]) for c in INVALID + TYPOS])
def test_invalid_generate_kwargs_raise_naming_field_and_accepted_values(tiny_model, kw, field, accepted):
    with pytest.raises(ValueError) as err:
        genkit.generate(tiny_model, torch.tensor([[1, 2, 3]]), **kw)
    _check(err, field, accepted)


NEGATIVE_EOS_WARNING = ("`eos_token_id` should consist of token ids >= 0, but is {!r}: a negative id matches no "
                        "token, so it never ends a row (with no other EOS id, generation will not stop until the "
                        "maximum length is reached).")
NEGATIVE_PAD_WARNING = ("`pad_token_id` should be a token id >= 0, but is -1: a negative id is no token, so genkit "
                        "treats it as unset (rows that finish early are padded with the first EOS id, else 0).")


def _generate(model, ids, seed=0, **kw):
    torch.manual_seed(seed)
    return genkit.generate(model, ids, max_new_tokens=12, **kw)


@pytest.mark.parametrize("kw", [{}, {"num_beams": 2}, {"min_new_tokens": 5}, {"do_sample": True},
                                {"forced_eos_token_id": 3}], ids=["greedy", "beams", "min_new_tokens", "sample",
                                                                  "forced_eos"])
@pytest.mark.parametrize("eos", [-1, [-1], [-5, -1]])
def test_negative_eos_token_id_matches_no_token(tiny_model, caplog, kw, eos):
    """transformers' "matches no token" sentinel: accepted with transformers' warning, and the
    generation runs to the maximum length with the tokens of eos_token_id=None."""
    ids = torch.tensor([[1, 5, 7, 9], [1, 4, 4, 8]])
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        ours = _generate(tiny_model, ids, eos_token_id=eos, **kw)
    assert NEGATIVE_EOS_WARNING.format(eos) in caplog.text
    assert ours.shape == (2, 4 + 12)
    assert torch.equal(ours, _generate(tiny_model, ids, eos_token_id=None, **kw))


def test_negative_eos_token_id_beside_a_real_one_ends_rows_at_the_real_one(tiny_model):
    ids = torch.tensor([[1, 5, 7, 9]])
    free = _generate(tiny_model, ids, eos_token_id=None)[0, 4:].tolist()
    eos = free[3]
    end = free.index(eos) + 1
    out = _generate(tiny_model, ids, eos_token_id=[-1, eos], return_dict_in_generate=True, output_scores=True)
    assert out.sequences[0, 4:].tolist() == free[:end]
    assert len(out.scores) == end


def test_negative_pad_token_id_is_treated_as_unset(tiny_model, caplog):
    """A row that finishes early is padded as with pad_token_id=None (the first EOS id), not with -1."""
    ids = torch.tensor([[1, 5, 7, 9], [1, 4, 4, 8]])
    first = _generate(tiny_model, ids, eos_token_id=None)[:, 4:]
    eos = int(first[0, 2])
    assert eos not in first[1, :3].tolist()  # row 0 ends first; row 1 goes on
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        ours = _generate(tiny_model, ids, eos_token_id=eos, pad_token_id=-1)
    assert NEGATIVE_PAD_WARNING in caplog.text
    assert torch.equal(ours, _generate(tiny_model, ids, eos_token_id=eos, pad_token_id=None))
    assert ours[0, 4 + 3:].tolist() == [eos] * (ours.shape[1] - 7)


def test_negative_ids_on_the_models_generation_config(tiny_model, caplog):
    """As transformers' GenerationTesterMixin sets them: on the model's generation config, generating
    to the maximum length."""
    model_config = tiny_model.generation_config.copy()
    try:
        tiny_model.generation_config.eos_token_id = tiny_model.generation_config.pad_token_id = -1
        with caplog.at_level(logging.WARNING, logger="genkit.config"):
            out = _generate(tiny_model, torch.tensor([[1, 5, 7, 9]]))
    finally:
        tiny_model.generation_config = model_config
    assert out.shape == (1, 16)
    assert NEGATIVE_EOS_WARNING.format(-1) in caplog.text
    assert caplog.text.count(NEGATIVE_PAD_WARNING) == 1


def test_a_model_configs_negative_ids_are_left_out_silently(caplog):
    """Many model configs say pad_token_id=-1 for "none": left out, as an unset field, no warning."""
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        config = GenerationConfig.from_model_config({"pad_token_id": -1, "eos_token_id": 2, "bos_token_id": 1})
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (None, 2, 1)
    assert caplog.text == ""


def test_negative_eos_token_id_saves_and_negative_pad_token_id_does_not_as_in_transformers(tmp_path):
    GenerationConfig(eos_token_id=-1).save_pretrained(tmp_path)
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == -1
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == -1
    config = GenerationConfig(pad_token_id=-1)
    with pytest.raises(ValueError) as err:
        config.save_pretrained(tmp_path / "pad")
    assert NEGATIVE_PAD_WARNING in str(err.value)
    with pytest.raises(ValueError):
        transformers.GenerationConfig(pad_token_id=-1).save_pretrained(tmp_path / "theirs")


def test_invalid_update():
    c = GenerationConfig()
    with pytest.raises(ValueError) as err:
        c.update(top_p=2.0)
    _check(err, "top_p", "(0, 1]")


def test_strict_validation_raises_for_knobs_that_do_nothing(caplog):
    c = GenerationConfig(temperature=0.5)  # greedy: temperature has no effect
    with pytest.raises(ValueError, match="temperature"):
        c.validate(strict=True)
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        c.validate()
    assert "temperature" in caplog.text


# -- round trips with transformers --------------------------------------------------------------

ROUND_TRIP = [
    {"max_new_tokens": 32},
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
    {"num_beams": 4, "length_penalty": 0.8, "early_stopping": True, "num_return_sequences": 2},
    {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "bad_words_ids": [[5], [7, 8]]},
    {"eos_token_id": [2, 5], "pad_token_id": 0, "bos_token_id": 1, "max_length": 40},
    {"min_new_tokens": 4, "max_new_tokens": 16, "stop_strings": ["\n\n", "END"]},
    {"do_sample": True, "min_p": 0.05, "typical_p": 0.9, "epsilon_cutoff": 3e-4},
    {"suppress_tokens": [3, 4], "begin_suppress_tokens": [5], "forced_bos_token_id": 1, "forced_eos_token_id": 2},
    {"exponential_decay_length_penalty": [4, 1.5], "renormalize_logits": True, "remove_invalid_values": True},
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
    {"output_scores": True, "return_dict_in_generate": True, "output_logits": True},
    {"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 2},
    {"sequence_bias": [[[4, 5], 2.0], [[6], -1.5]], "encoder_repetition_penalty": 1.2},
    {"do_sample": True, "eta_cutoff": 1e-3, "top_h": 0.5, "max_time": 2.5, "top_k": 0},
    {"cache_implementation": "static", "max_length": 64, "min_length": 3},
    {"num_assistant_tokens": 10, "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.3},
]


def _norm(v):
    return json.loads(json.dumps(v))


@pytest.mark.parametrize("kw", ROUND_TRIP, ids=[",".join(sorted(k)) for k in ROUND_TRIP])
def test_genkit_save_transformers_load(tmp_path, kw):
    ours = GenerationConfig(**kw)
    ours.save_pretrained(tmp_path)
    ref = transformers.GenerationConfig.from_pretrained(tmp_path)
    for key, value in kw.items():
        assert _norm(getattr(ref, key)) == _norm(value), key
    # every field genkit wrote reads back with the same value in transformers
    for key, value in json.loads((tmp_path / "generation_config.json").read_text()).items():
        assert _norm(getattr(ref, key)) == value, key


@pytest.mark.parametrize("kw", ROUND_TRIP, ids=[",".join(sorted(k)) for k in ROUND_TRIP])
def test_transformers_save_genkit_load(tmp_path, kw):
    ref = transformers.GenerationConfig(**kw)
    ref.save_pretrained(tmp_path)
    ours = GenerationConfig.from_pretrained(tmp_path)
    for key, value in kw.items():
        assert _norm(getattr(ours, key)) == _norm(value), key
    written = json.loads((tmp_path / "generation_config.json").read_text())
    for key, value in written.items():
        if key in ("transformers_version", "_from_model_config"):
            continue
        assert _norm(getattr(ours, key)) == value, key
    # and back again: genkit's file loads in transformers to the same values
    ours.save_pretrained(tmp_path / "again")
    back = transformers.GenerationConfig.from_pretrained(tmp_path / "again")
    for key in kw:
        assert _norm(getattr(back, key)) == _norm(getattr(ref, key)), key


def test_transformers_sequence_bias_dict_file_loads_in_genkit(tmp_path):
    """transformers writes a dict sequence_bias with string keys "(4, 5)"; genkit reads them back."""
    ref = transformers.GenerationConfig(sequence_bias={(4, 5): 2.0, (6,): -1.0})
    ref.save_pretrained(tmp_path)
    ours = GenerationConfig.from_pretrained(tmp_path)
    from genkit.builtin_strategies.logits_process import SequenceBiasLogitsProcessor

    assert SequenceBiasLogitsProcessor(ours.sequence_bias).sequence_bias == {(4, 5): 2.0, (6,): -1.0}


def test_from_pretrained_options(tmp_path):
    GenerationConfig(max_new_tokens=7, do_sample=True, top_k=3).save_pretrained(tmp_path / "sub",
                                                                               config_file_name="custom.json")
    c = GenerationConfig.from_pretrained(tmp_path, config_file_name="custom.json", subfolder="sub")
    assert c.max_new_tokens == 7 and c.top_k == 3
    c, unused = GenerationConfig.from_pretrained(tmp_path / "sub", config_file_name="custom.json",
                                                 return_unused_kwargs=True, top_k=9, foo=1)
    assert c.top_k == 9 and unused == {"foo": 1}
    with pytest.raises(FileNotFoundError):
        GenerationConfig.from_pretrained(tmp_path / "sub")
    with pytest.raises(ValueError) as err:
        GenerationConfig.from_pretrained(tmp_path / "sub", config_file_name="custom.json", top_k=-5)
    _check(err, "top_k", ">= 0")


# -- dict / repr / eq / update / from_model_config -----------------------------------------------

def test_defaults_match_transformers_documented_behaviour(tiny_model):
    c = GenerationConfig()  # transformers 5: every field unset, the defaults apply at generate time
    assert c.max_length is None and c.do_sample is None and c.num_beams is None and c.top_k is None
    d = c.with_defaults()
    assert d.max_length == 20 and d.do_sample is False and d.num_beams == 1 and d.top_k == 50
    assert c.get_generation_mode() == "greedy_search"
    assert GenerationConfig(do_sample=True).get_generation_mode() == "sample"
    assert tiny_model.generation_config.max_length is None


def test_update_returns_unused_keys_and_validates():
    c = GenerationConfig()
    unused = c.update(max_new_tokens=5, temperature=0.3, not_a_field=1, other=[2])
    assert unused == {"not_a_field": 1, "other": [2]}
    assert c.max_new_tokens == 5 and c.temperature == 0.3
    ref = transformers.GenerationConfig()
    assert ref.update(max_new_tokens=5, not_a_field=1) == {"not_a_field": 1}


def test_repr_shows_only_non_defaults():
    c = GenerationConfig(max_new_tokens=12, do_sample=True, top_p=0.8)
    text = repr(c)
    assert text.startswith("GenerationConfig ")
    shown = json.loads(text[len("GenerationConfig "):])
    assert shown == {"max_new_tokens": 12, "do_sample": True, "top_p": 0.8}
    assert json.loads(repr(GenerationConfig())[len("GenerationConfig "):]) == {}


def test_equality_and_copy():
    a = GenerationConfig(max_new_tokens=5, top_k=7)
    b = GenerationConfig(top_k=7, max_new_tokens=5)
    assert a == b
    assert a != GenerationConfig(max_new_tokens=6, top_k=7)
    # as in transformers 5: a field set to its default is set, an unset field is not
    assert GenerationConfig() != GenerationConfig(top_k=50)
    assert (GenerationConfig() == GenerationConfig(top_k=50)) == (transformers.GenerationConfig()
                                                                 == transformers.GenerationConfig(top_k=50))
    c = a.copy()
    c.update(top_k=8)
    assert a.top_k == 7 and a != c
    assert (a == "x") is False


def test_to_dict_and_to_json_string():
    c = GenerationConfig(max_new_tokens=5, eos_token_id=[1, 2])
    d = c.to_dict()
    assert d["max_new_tokens"] == 5 and d["eos_token_id"] == [1, 2] and d["max_length"] is None
    assert set(d) >= {"temperature", "top_k", "top_p", "repetition_penalty", "bad_words_ids"}
    assert json.loads(c.to_json_string()) == {"max_new_tokens": 5, "eos_token_id": [1, 2]}
    full = json.loads(c.to_json_string(use_diff=False))
    assert full["top_k"] is None and full["max_new_tokens"] == 5
    assert GenerationConfig.from_dict(full) == c
    d["max_new_tokens"] = 99  # a copy, not a view
    assert c.max_new_tokens == 5


def test_from_model_config():
    mc = {"vocab_size": 128, "hidden_size": 64, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0,
          "max_length": 30, "temperature": 0.9, "top_k": "not-a-number"}
    c = GenerationConfig.from_model_config(mc)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, [2, 3], 0)
    assert c.max_length == 30 and c.temperature == 0.9 and c.top_k is None  # an invalid value is left out
    hf_cfg = transformers.LlamaConfig(bos_token_id=5, eos_token_id=6, pad_token_id=7)
    c = GenerationConfig.from_model_config(hf_cfg)
    ref = transformers.GenerationConfig.from_model_config(hf_cfg)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)


def test_config_merge_order_model_then_config_then_kwargs(tiny_model):
    """model's generation_config < generation_config argument < kwargs."""
    ids = torch.tensor([[1, 2, 3]])
    out = tiny_model.generate(ids, generation_config=GenerationConfig(max_new_tokens=4), eos_token_id=None)
    assert out.shape[1] == 7
    out = tiny_model.generate(ids, generation_config=GenerationConfig(max_new_tokens=4), max_new_tokens=2,
                              eos_token_id=None)
    assert out.shape[1] == 5
    assert tiny_model.generation_config.max_new_tokens is None  # not mutated
