"""The config a generation runs with is resolved in steps that each return a new read-only
``ResolvedConfig`` (issue 26, item 7): nothing writes into a config after it is resolved, and the
caller's ``GenerationConfig`` is never changed."""

from __future__ import annotations

import copy

import pytest
import torch

import genkit
from genkit import GenerationConfig
from genkit.config import ResolvedConfig, merge_for_generate, resolve_lengths, resolve_special_tokens
from genkit.errors import FrozenConfigError, GenkitError

IDS = torch.tensor([[5, 6, 7, 8]])


def test_a_merged_config_is_read_only_and_its_copy_is_not():
    config, _ = merge_for_generate(None, GenerationConfig(top_p=0.5), {"max_new_tokens": 3})
    assert isinstance(config, ResolvedConfig) and isinstance(config, GenerationConfig)
    with pytest.raises(FrozenConfigError, match="read-only: cannot set `max_length`"):
        config.max_length = 7
    with pytest.raises(AttributeError, match="cannot set `top_p`"):  # the builtin base a caller expects
        config.update(top_p=0.9)
    with pytest.raises(GenkitError, match="cannot set `custom_key`"):
        config.custom_key = 1
    mutable = config.copy()
    assert type(mutable) is GenerationConfig and mutable == config
    mutable.max_length = 7
    assert (mutable.max_length, config.max_length) == (7, 20)


def test_each_resolution_step_returns_a_new_config():
    merged, _ = merge_for_generate(None, None, {"max_new_tokens": 3, "min_new_tokens": 2})
    lengths = resolve_lengths(merged, input_length=4)
    assert (lengths.max_length, lengths.min_length) == (7, 6)
    assert (merged.max_length, merged.min_length) == (20, 0)  # the merged config is unchanged
    assert lengths.user_set == merged.user_set == {"max_new_tokens", "min_new_tokens"}
    # an unset max_length counts new tokens, capped at the model's positions
    default, _ = merge_for_generate(None, None, {})
    assert resolve_lengths(default, input_length=4).max_length == 24
    assert resolve_lengths(default, input_length=4, max_positions=10).max_length == 10


def test_special_tokens_come_from_the_model_config_and_pad_from_eos():
    merged, _ = merge_for_generate(None, None, {})
    # an invalid id in a model config (pad -1) is left out, as from_model_config leaves it out
    resolved = resolve_special_tokens(merged, {"eos_token_id": [3, 4], "bos_token_id": 1, "pad_token_id": -1})
    assert (resolved.eos_token_id, resolved.bos_token_id, resolved.pad_token_id) == ([3, 4], 1, 3)
    assert (merged.eos_token_id, merged.pad_token_id) == (None, None)
    given, _ = merge_for_generate(None, None, {"eos_token_id": 9})  # the call's ids win
    assert resolve_special_tokens(given, {"eos_token_id": 3}).eos_token_id == 9


def test_a_strategy_reads_the_resolved_config_and_the_callers_config_is_untouched(tiny_model):
    seen = {}

    def keep_config(model, input_ids, generation_config=None, **kwargs):
        seen["config"] = generation_config
        return input_ids

    mine = GenerationConfig(max_new_tokens=5, min_new_tokens=2, eos_token_id=3)
    before = mine.to_json_string(use_diff=False)
    genkit.generate(tiny_model, IDS, generation_config=mine, custom_generate=keep_config)
    config = seen["config"]
    assert isinstance(config, ResolvedConfig)
    assert (config.max_length, config.min_length, config.eos_token_id, config.pad_token_id) == (9, 6, 3, 0)
    assert mine.to_json_string(use_diff=False) == before and mine.max_length is None


def test_the_assistant_is_recorded_for_strategy_selection_and_never_copied(tiny_model):
    merged, _ = merge_for_generate(None, None, {})
    with_assistant = merged.replace(assistant_model=tiny_model)
    assert merged.assistant_model is None and with_assistant.assistant_model is tiny_model
    from genkit.plugins import get_registry

    assert get_registry().select_strategy(with_assistant).name == "assisted"
    assert copy.deepcopy(with_assistant).assistant_model is tiny_model
    with pytest.raises(genkit.errors.ConfigError, match="`max_lenght` is not a GenerationConfig field"):
        merged.replace(max_lenght=3)
