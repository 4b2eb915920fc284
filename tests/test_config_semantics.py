"""GenerationConfig behaves as transformers 5's (issue 18, items 1-5): ``None`` means "use the
default", warnings know where each value came from, ``save_pretrained`` refuses an inconsistent
config, unknown keys are kept as custom entries, ``get_generation_mode`` speaks transformers'
names. transformers 5 is the oracle throughout."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

import genkit
from genkit import GenerationConfig
from genkit.config import default_values, field_table

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
MASK = (IDS != 0).long()


def _config_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "genkit.config" and r.levelno == logging.WARNING]


# -- item 1: None means "use the default" --------------------------------------------------------

def test_every_field_defaults_to_none_and_the_global_defaults_are_transformers():
    ours, ref = GenerationConfig(), transformers.GenerationConfig()
    shared = set(field_table()) & set(ref.to_dict())
    assert len(shared) > 60
    for name in shared:
        assert getattr(ours, name) is None and getattr(ref, name) is None, name
    theirs = transformers.GenerationConfig._get_default_generation_params()
    defaults = default_values()
    for name, value in theirs.items():
        assert defaults.get(name) == value, name
    # genkit's other defaults change nothing: a False flag where transformers has None
    extra = {k: v for k, v in defaults.items() if k not in theirs}
    assert all(v is False for v in extra.values()), extra


def _greedy(model, **kw):
    kw = {"attention_mask": MASK, "max_new_tokens": 6, "pad_token_id": 0, **kw}
    return model.generate(IDS, **kw)


# transformers 5 fails on None for these (TypeError deep in generate); genkit uses the default
TRANSFORMERS_FAILS_ON_NONE = {"num_beams", "num_return_sequences"}
# transformers 5 runs without a cache for use_cache=None and its tokens change; genkit uses the default (True)
TRANSFORMERS_DIFFERS_ON_NONE = {"use_cache"}


def test_none_for_every_field_through_generate_is_the_default(tiny_pair):
    """Every field, passed as None to generate, gives the tokens of the call without it; and all of
    them at once give the tokens transformers 5 gives for the same call (where it runs)."""
    hf, ours = tiny_pair
    plain = _greedy(ours)
    assert torch.equal(plain, _greedy(hf))
    every = sorted(set(field_table()) - {"max_new_tokens"})
    for name in every:
        assert torch.equal(_greedy(ours, **{name: None}), plain), name
    assert torch.equal(_greedy(ours, **dict.fromkeys(every)), plain)
    hf_fields = set(transformers.GenerationConfig().to_dict()) - TRANSFORMERS_FAILS_ON_NONE - \
        TRANSFORMERS_DIFFERS_ON_NONE - {"transformers_version", "_from_model_config", "max_new_tokens"}
    assert len(hf_fields) > 60
    assert torch.equal(_greedy(hf, **dict.fromkeys(hf_fields)), plain)
    with pytest.raises(TypeError):  # the reason for the exception list above
        _greedy(hf, num_beams=None)
    # max_new_tokens=None: the default length (20 new tokens), as in transformers
    with pytest.warns(UserWarning):
        ref = _greedy(hf, max_new_tokens=None)
    assert ref.shape[1] == IDS.shape[1] + 20 and torch.equal(_greedy(ours, max_new_tokens=None), ref)


def test_none_for_the_processor_fields_when_sampling_is_as_in_transformers(tiny_pair):
    """Sampling: a processor field passed as None turns that processor off, as in transformers 5
    (for ``top_k`` this differs from leaving it unset, which samples with top-k 50)."""
    from genkit.builtin_strategies.fields import ALL

    hf, ours = tiny_pair
    kw = {"do_sample": True, "max_new_tokens": 8, "attention_mask": MASK, "eos_token_id": None, "pad_token_id": 0}
    nones = {spec.name: None for spec in ALL}
    for extra in (nones, {"top_k": None}, {}):
        torch.manual_seed(3)
        ref = hf.generate(IDS, **kw, **extra)
        torch.manual_seed(3)
        assert torch.equal(ours.generate(IDS, **kw, **extra), ref), extra
    torch.manual_seed(3)
    unset = ours.generate(IDS, **kw)
    torch.manual_seed(3)
    assert not torch.equal(unset, ours.generate(IDS, **kw, top_k=None))


def test_default_max_length_counts_new_tokens_as_in_transformers(tiny_pair):
    """No length anywhere: 20 new tokens (transformers 5), whatever the prompt length."""
    hf, ours = tiny_pair
    prompt = torch.arange(3, 28).unsqueeze(0)  # 25 tokens, longer than the old 20 in all
    got = ours.generate(prompt, eos_token_id=None)
    assert got.shape == (1, 45)
    with pytest.warns(UserWarning):
        ref = hf.generate(prompt, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, ref)
    assert ours.generate(prompt, eos_token_id=None, max_length=30).shape == (1, 30)  # set: it is the total



PASSED_AT_DEFAULT = [  # (the model's generation config, a transformers GenerationConfig the caller passes)
    ({"repetition_penalty": 3.0}, {"repetition_penalty": 1.0, "max_new_tokens": 8, "do_sample": False}),
    ({"num_beams": 3}, {"num_beams": 1, "max_new_tokens": 8, "do_sample": False}),
    ({"do_sample": True, "temperature": 1.5}, {"do_sample": False, "max_new_tokens": 8}),
    ({"no_repeat_ngram_size": 1}, {"no_repeat_ngram_size": 0, "max_new_tokens": 8, "do_sample": False}),
    ({}, {"max_length": 20, "do_sample": False}),  # set: the whole length (unset: 20 after the prompt)
]


@pytest.mark.parametrize(("model_fields", "passed"), PASSED_AT_DEFAULT, ids=[str(p) for _, p in PASSED_AT_DEFAULT])
def test_a_passed_transformers_config_keeps_what_it_sets_to_a_global_default(tiny_pair, model_fields, passed):
    """A transformers ``GenerationConfig`` passed to generate keeps every field it sets, one at
    transformers' global default included, over the model's generation config (``do_sample=False``
    for a model whose config samples): as transformers does, natively and through the adapter."""
    hf, ours = tiny_pair
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    saved = (hf.generation_config, ours.generation_config)
    try:
        hf.generation_config = transformers.GenerationConfig(**{**hf.generation_config.to_diff_dict(), **model_fields})
        ours.generation_config = GenerationConfig(**model_fields)
        outs = []
        for model in (hf, ours, hf):  # transformers, genkit's native model, genkit on the transformers model
            torch.manual_seed(1)
            run = model.generate if not outs else lambda *a, **k: genkit.generate(model, *a, **k)
            outs.append(run(prompt, generation_config=transformers.GenerationConfig(**passed), eos_token_id=None,
                            pad_token_id=0))
    finally:
        hf.generation_config, ours.generation_config = saved
    assert outs[0].shape[1] == (20 if "max_length" in passed else prompt.shape[1] + 8)
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_model_values_fill_what_the_call_leaves_unset(tiny_model):
    from genkit.config import merge_for_generate

    model_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, chat_template_name="x")
    config, rest = merge_for_generate(model_config, GenerationConfig(top_p=0.5), {"max_new_tokens": 3, "foo": 1})
    assert (config.do_sample, config.temperature, config.top_p, config.max_new_tokens) == (True, 0.6, 0.5, 3)
    assert config.top_k == 50 and config.num_beams == 1  # global defaults
    assert config.chat_template_name == "x"  # a custom entry of the model's config is carried over
    assert rest == {"foo": 1}
    assert config.user_set == {"top_p", "max_new_tokens"}


# -- item 2: warnings with provenance, once ---------------------------------------------------------

def _sampling_model(tiny_model):
    tiny_model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)
    return tiny_model


def test_greedy_call_on_a_sampling_model_logs_nothing(tiny_model, caplog):
    model = _sampling_model(tiny_model)
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        for _ in range(2):
            model.generate(IDS[:1], max_new_tokens=3, do_sample=False)
    assert _config_warnings(caplog) == []


def test_a_flag_the_caller_sets_is_warned_about_once(tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        for _ in range(3):
            tiny_model.generate(IDS[:1], max_new_tokens=3, temperature=0.5)
    warned = _config_warnings(caplog)
    assert len(warned) == 1 and "`temperature`" in warned[0] and "do_sample" in warned[0]


def test_both_lengths_are_warned_about_only_when_they_disagree(tiny_model, caplog):
    """``max_new_tokens`` wins either way; a ``max_length`` equal to prompt + ``max_new_tokens`` is no
    conflict (a recipe handing its resolved config and the caller's arguments on), another one is."""
    prompt = IDS[:1]
    n = prompt.shape[1]
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        out = tiny_model.generate(prompt, max_new_tokens=3, max_length=n + 3, do_sample=False)
    assert out.shape[1] == n + 3 and _config_warnings(caplog) == []
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        out = tiny_model.generate(prompt, max_new_tokens=3, max_length=n + 11, do_sample=False)
    assert out.shape[1] == n + 3
    assert [m for m in _config_warnings(caplog) if "takes precedence" in m] == [
        f"both `max_new_tokens` (=3) and `max_length` (={n + 11}) are set; `max_new_tokens` takes precedence."]


# (config, fields the caller set (None: all)) -> transformers 5 and genkit flag the same fields
PROVENANCE = [
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"do_sample"}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {"do_sample", "temperature"}),
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, set()),
    ({"temperature": 0.5, "top_k": 20, "min_p": 0.1}, None),
    ({"num_beams": 1, "length_penalty": 0.5, "early_stopping": True}, {"num_beams"}),
    ({"length_penalty": 0.5, "early_stopping": True}, {"length_penalty"}),
    ({"output_scores": True, "output_logits": True}, None),
    ({"output_scores": True, "return_dict_in_generate": True}, None),
    ({"do_sample": True, "temperature": 0.7}, None),
    ({"use_cache": False, "cache_implementation": "static"}, None),
]


def _flagged(err: Exception) -> set[str]:
    return set(re.findall(r"^- `(\w+)`", str(err), flags=re.MULTILINE))


@pytest.mark.parametrize(("kw", "user_set"), PROVENANCE, ids=[f"{sorted(k)}-{None if u is None else sorted(u)}" for k, u in PROVENANCE])
def test_flags_warned_about_are_transformers_flags(kw, user_set):
    expected: set[str] = set()
    try:
        transformers.GenerationConfig(**kw).validate(strict=True, user_set_attributes=user_set)
    except ValueError as err:
        expected = _flagged(err)
    got: set[str] = set()
    try:
        GenerationConfig(**kw).validate(strict=True, user_set_attributes=user_set)
    except ValueError as err:
        got = _flagged(err)
    assert got == expected


def test_validate_warns_about_output_flags_without_return_dict(caplog):
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        GenerationConfig(output_scores=True).validate()
    assert any("`output_scores`" in m and "return_dict_in_generate" in m for m in _config_warnings(caplog))


# -- item 3: save_pretrained refuses an inconsistent config -----------------------------------------

def test_save_pretrained_refuses_an_inconsistent_config_and_writes_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(ValueError) as ref_err:
        transformers.GenerationConfig(temperature=0.5).save_pretrained(target)
    assert not target.exists()
    with pytest.raises(ValueError) as err:
        GenerationConfig(temperature=0.5).save_pretrained(target)
    assert "`temperature`" in str(err.value) and "Fix these issues to save the configuration" in str(err.value)
    assert _flagged(err.value) == _flagged(ref_err.value) == {"temperature"}
    assert not target.exists()


def test_a_loaded_config_saved_unchanged_is_only_warned_about(tmp_path, caplog):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        loaded = GenerationConfig.from_pretrained(tmp_path / "src")
    assert any("`temperature`" in m for m in _config_warnings(caplog))
    loaded.save_pretrained(tmp_path / "copy")  # unchanged since loaded: saved back
    assert json.loads((tmp_path / "copy" / "generation_config.json").read_text()) == {"temperature": 0.5}
    loaded.top_p = 0.8  # changed: strict again
    with pytest.raises(ValueError, match="top_p"):
        loaded.save_pretrained(tmp_path / "changed")
    assert not (tmp_path / "changed").exists()


# -- item 4: unknown keys are custom entries; generate still refuses unknown keywords ----------------

def test_unknown_keys_are_kept_written_and_read_by_transformers(tmp_path):
    c = GenerationConfig(max_new_tokens=4, foo="bar")
    assert c.foo == "bar" and c.custom_entries() == {"foo": "bar"}
    c.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"max_new_tokens": 4, "foo": "bar"}
    assert transformers.GenerationConfig.from_pretrained(tmp_path).foo == "bar"
    assert GenerationConfig.from_pretrained(tmp_path).foo == "bar"


def test_a_key_close_to_a_field_warns_did_you_mean(caplog):
    with caplog.at_level(logging.WARNING, logger="genkit.config"):
        c = GenerationConfig(temprature=0.3)
        c.max_new_tokns = 5
    assert c.temprature == 0.3 and c.max_new_tokns == 5 and c.temperature is None
    warned = " ".join(_config_warnings(caplog))
    assert "Did you mean `temperature`?" in warned and "Did you mean `max_new_tokens`?" in warned


def test_generate_still_refuses_unknown_keywords_with_the_closest_name(tiny_model):
    with pytest.raises(ValueError, match=r"`temprature` is not a generation parameter.*Did you mean `temperature`"):
        tiny_model.generate(IDS[:1], max_new_tokens=2, temprature=0.5)


def test_generate_arguments_inside_a_config_are_refused():
    with pytest.raises(ValueError, match="`streamer` is not a GenerationConfig entry; pass it to generate"):
        GenerationConfig(streamer=object())


def test_from_pretrained_config_name(tmp_path):
    GenerationConfig(max_new_tokens=9).save_pretrained(tmp_path, config_file_name="chat.json")
    assert GenerationConfig.from_pretrained(tmp_path, config_name="chat.json").max_new_tokens == 9
    assert GenerationConfig.from_pretrained(tmp_path, config_file_name="chat.json").max_new_tokens == 9
    assert GenerationConfig.from_pretrained(tmp_path, "chat.json").max_new_tokens == 9
    with pytest.raises(ValueError, match="`config_file_name` or its alias `config_name`"):
        GenerationConfig.from_pretrained(tmp_path, config_file_name="a.json", config_name="chat.json")


# -- item 5: GenerationMode ------------------------------------------------------------------------

MODES = [
    {}, {"do_sample": True}, {"num_beams": 3}, {"num_beams": 3, "do_sample": True},
    {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
    {"num_beams": 3, "force_words_ids": [[5]]}, {"prompt_lookup_num_tokens": 3},
    {"do_sample": True, "prompt_lookup_num_tokens": 3}, {"top_k": 4}, {"temperature": 0.7, "do_sample": True},
]


@pytest.mark.parametrize("kw", MODES, ids=[str(k) for k in MODES])
def test_generation_mode_is_transformers_mode(kw):
    ours = GenerationConfig(**kw).get_generation_mode()
    ref = transformers.GenerationConfig(**kw).get_generation_mode()
    assert isinstance(ours, genkit.GenerationMode)
    assert ours == ref and ours.value == ref.value and str(ours) == ref.value


def test_generation_mode_with_an_assistant_model(tiny_model):
    assert GenerationConfig().get_generation_mode(assistant_model=tiny_model) == "assisted_generation"
    assert GenerationConfig().strategy_name(assistant_model=tiny_model) == "assisted"
    assert genkit.GenerationMode("beam_sample") is genkit.GenerationMode.BEAM_SAMPLE
    with pytest.raises(ValueError, match="'beam' is not a valid GenerationMode; choose one of"):
        genkit.GenerationMode("beam")


def test_each_builtin_strategy_has_a_mode():
    from genkit.generation_mode import STRATEGY_MODES
    from genkit.plugins import get_registry

    builtin = [n for n, item in get_registry().items["strategy"].items() if item.origin.kind == "builtin"]
    assert builtin and all(n in STRATEGY_MODES for n in builtin), builtin


# -- update(defaults_only=, allow_custom_entries=) -----------------------------------------------

@pytest.mark.parametrize("options", [{}, {"defaults_only": True}, {"allow_custom_entries": True},
                                     {"defaults_only": True, "allow_custom_entries": True}], ids=str)
def test_update_options_as_in_transformers(options):
    start = {"do_sample": True, "top_k": 5, "note": "kept"}
    change = {"top_k": 7, "top_p": 0.5, "note": "new", "extra": 1}
    ours, ref = GenerationConfig(**start), transformers.GenerationConfig(**start)
    assert ours.update(**options, **change) == ref.update(**options, **change)
    for name in ("top_k", "top_p", "note"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert getattr(ours, "extra", None) == getattr(ref, "extra", None)


# -- an honest config (issue 10, item 7): a plugin that declares an unsupported field implements it --

def test_a_field_declared_by_a_plugin_counts_as_implemented(tiny_model):
    from genkit.errors import NotSupportedError
    from genkit.plugins import FieldSpec, register_plugin, reset_registry

    with pytest.raises(NotSupportedError, match="`token_healing`=True"):
        tiny_model.generate(IDS[:1], max_new_tokens=2, token_healing=True)
    seen = []

    class Healing:
        @genkit.hookimpl
        def register_logits_processors(self, register):
            def make(config, ctx):
                seen.append(config.token_healing)

            register("token_healing_demo", make, fields=[FieldSpec("token_healing", False, lambda v: isinstance(
                v, bool), "True or False")], order=10)

    reset_registry()
    try:
        register_plugin(Healing(), name="healing")
        tiny_model.generate(IDS[:1], max_new_tokens=2, token_healing=True)
        assert seen == [True]
    finally:
        reset_registry()
    with pytest.raises(NotSupportedError):
        tiny_model.generate(IDS[:1], max_new_tokens=2, token_healing=True)


def test_a_field_registered_after_the_tables_were_read_is_in_them():
    """The field table and its defaults are kept per registry state: a plugin registered into a
    registry whose tables were already read (a server's requests read them) adds its field."""
    from genkit.config import default_values, field_table, none_means_off
    from genkit.plugins import FieldSpec, register_plugin, reset_registry

    class Late:
        @genkit.hookimpl
        def register_logits_processors(self, register):
            register("late_knob_demo", lambda config, ctx: None, order=10,
                     fields=[FieldSpec("late_knob", 3, lambda v: isinstance(v, int), "an int", off_when_none=True)])

    reset_registry()
    try:
        assert "late_knob" not in field_table() and "late_knob" not in default_values()
        register_plugin(Late(), name="late-knob")
        assert field_table()["late_knob"].default == 3
        assert default_values()["late_knob"] == 3 and "late_knob" in none_means_off()
        assert genkit.GenerationConfig(late_knob=5).late_knob == 5
    finally:
        reset_registry()
    assert "late_knob" not in field_table()


def test_unsupported_values_say_what_to_use_instead(tiny_model):
    from genkit.errors import NotSupportedError

    with pytest.raises(NotSupportedError, match=r"`cache_implementation`='quantized' \(a quantized KV cache"):
        tiny_model.generate(IDS[:1], max_new_tokens=2, cache_implementation="quantized")
    with pytest.raises(NotSupportedError, match="pick a draft source with candidate_generator="):
        tiny_model.generate(IDS[:1], max_new_tokens=2, speculation_type="tree")
    out = tiny_model.generate(IDS[:1], max_new_tokens=2, cache_implementation="offloaded")  # no effect
    assert torch.equal(out, tiny_model.generate(IDS[:1], max_new_tokens=2))
