"""genkit.strategy: the stepper's logits equal a fresh full forward (cache, left padding, row
reorder, rollback, several tokens, no cache, a transformers model), partial depth is a declared
hook, the finish tracker ends the streamer on every exit path, and the call is one frozen object."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.builtin_strategies.decoding import greedy_search
from genkit.errors import ConfigError, NotSupportedError
from genkit.generation.api import prepare
from genkit.strategy import FinishTracker, Stepper, StopConditions, StrategyCall

IDS = torch.tensor([[0, 0, 5, 6, 7], [1, 9, 8, 7, 6], [0, 3, 4, 5, 6]])
MASK = (IDS != 0).long()


def _call(model, ids=IDS, mask=MASK, **kw):
    p = prepare(model, ids, None, None, None, None, None, dict(attention_mask=mask, max_new_tokens=8, **kw))
    return StrategyCall.from_kwargs("test", model, p.input_ids, logits_processor=p.logits_processor,
                                    stopping_criteria=p.stopping_criteria, generation_config=p.config,
                                    streamer=p.streamer, **p.model_kwargs)


def _full(model, seqs, mask):
    """Last-position logits of a fresh forward over whole sequences (no cache)."""
    return model(seqs, attention_mask=mask, use_cache=False).logits[:, -1].float()


def _assert_full(logits, model, seqs, mask, repeat=1):
    """``logits`` are :func:`_full`'s (each row ``repeat`` times), within the rounding of two
    evaluations of the model in different orders (tests/tolerance.py)."""
    want = _full(model, seqs, mask).repeat_interleave(repeat, 0)
    torch.testing.assert_close(logits, want, atol=logits_bound(model, seqs, mask), rtol=0)


def _mask_for(seqs, mask):
    return torch.cat([mask, torch.ones(seqs.shape[0], seqs.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_prefill_and_steps_match_full_forwards(tiny_model, use_cache):
    call = _call(tiny_model, use_cache=use_cache)
    stepper = Stepper(call)
    logits = stepper.prefill()
    _assert_full(logits, tiny_model, IDS, MASK)
    for _ in range(4):
        logits = stepper.step(logits.argmax(-1))
        seqs = stepper.sequences
        _assert_full(logits, tiny_model, seqs, _mask_for(seqs, MASK))
    assert (stepper.cache is not None) == use_cache and stepper.length == IDS.shape[1] + 4


def test_rows_reorder_sequences_cache_mask_and_positions(tiny_model):
    stepper = Stepper(_call(tiny_model))
    logits = stepper.prefill()
    logits = stepper.step(logits.argmax(-1))
    rows = torch.tensor([2, 2, 0])
    before = stepper.sequences.clone()
    logits = stepper.step(torch.tensor([11, 12, 13]), rows=rows)
    expect = torch.cat([before[rows], torch.tensor([[11], [12], [13]])], dim=1)
    assert torch.equal(stepper.sequences, expect)
    _assert_full(logits, tiny_model, expect, _mask_for(expect, MASK[rows]))


def test_several_tokens_and_rollback(tiny_model):
    ids, mask = IDS[1:2], MASK[1:2]
    stepper = Stepper(_call(tiny_model, ids, mask))
    stepper.prefill()
    draft = torch.tensor([[20, 21, 22]])
    logits = stepper.step(draft)
    assert logits.shape == (1, 3, tiny_model.config.vocab_size)
    seqs = torch.cat([ids, draft], 1)
    full = tiny_model(seqs, use_cache=False).logits[:, -3:].float()
    torch.testing.assert_close(logits, full, atol=logits_bound(tiny_model, seqs), rtol=0)
    stepper.crop(ids.shape[1] + 1)  # keep the first drafted token
    assert stepper.cache.get_seq_length() == ids.shape[1] + 1
    logits = stepper.step(torch.tensor([30]))
    seqs = torch.cat([ids, torch.tensor([[20, 30]])], 1)
    _assert_full(logits, tiny_model, seqs, None)
    with pytest.raises(ConfigError, match="cannot crop to 99 tokens: the sequences hold 7"):
        stepper.crop(99)


def test_advance_runs_a_step_without_the_head(tiny_model):
    """advance() fills the cache and the hidden states as forward() does; the head on the final
    hidden state gives forward's logits."""
    stepper = Stepper(_call(tiny_model), output_hidden_states=True)
    logits = stepper.prefill()
    stepper.push(logits.argmax(-1))
    stepper.advance()
    final = stepper.hidden_states[-1]
    assert final.shape[1] == 1 and stepper.cache.get_seq_length() == IDS.shape[1] + 1
    seqs = stepper.sequences
    head = tiny_model.output_logits(final[:, -1], stepper.cache).float()
    _assert_full(head, tiny_model, seqs, _mask_for(seqs, MASK))
    logits = stepper.step(head.argmax(-1))  # and the steps after it go on from there
    seqs = stepper.sequences
    _assert_full(logits, tiny_model, seqs, _mask_for(seqs, MASK))


def test_rows_per_prompt_expands_after_one_prefill(tiny_model):
    stepper = Stepper(_call(tiny_model), rows_per_prompt=2, output_hidden_states=True)
    logits = stepper.prefill()
    assert logits.shape[0] == 6 and stepper.cache.get_seq_length() == IDS.shape[1]
    _assert_full(logits, tiny_model, IDS, MASK, repeat=2)
    assert stepper.hidden_states[0].shape[0] == 6
    logits = stepper.step(torch.arange(6) + 10, rows=torch.tensor([1, 0, 3, 2, 5, 4]))
    seqs = stepper.sequences
    _assert_full(logits, tiny_model, seqs, _mask_for(seqs, MASK.repeat_interleave(2, 0)))


def test_a_transformers_model_and_its_cache(tiny_pair):
    hf, _ = tiny_pair
    model = genkit.generation.api.as_protocol_model(hf)
    stepper = Stepper(_call(model))
    logits = stepper.prefill()
    logits = stepper.step(logits.argmax(-1), rows=torch.tensor([1, 0, 2]))
    seqs = stepper.sequences
    mask = _mask_for(seqs, MASK[[1, 0, 2]])
    _assert_full(logits, hf, seqs, mask)
    assert isinstance(stepper.cache, genkit.strategy.Cache)


class EarlyExitLlama:
    """A user model that implements the partial-depth protocol on top of a native model."""

    supports_partial_depth = True

    def __init__(self, model):
        self.model, self.config, self.depths = model, model.config, []

    def __call__(self, input_ids, *, num_layers=None, logits_to_keep=0, output_hidden_states=False, **kw):
        self.depths.append(num_layers)
        out = self.model(input_ids, output_hidden_states=True, logits_to_keep=logits_to_keep, **kw)
        if num_layers is not None:
            out.logits = self.model.lm_head_logits(out.hidden_states[num_layers][:, -max(logits_to_keep, 1):])
        return out

    def new_cache(self, max_length=0):
        return self.model.new_cache(max_length)


def test_partial_depth_is_a_declared_hook(tiny_model, tiny_pair):
    ids, mask = IDS[1:2], MASK[1:2]
    adapted = genkit.generation.api.as_protocol_model(tiny_pair[0])  # a transformers model: no partial depth
    with pytest.raises(NotSupportedError, match=r"partial depth \(num_layers=1\) is not supported by "):
        Stepper(_call(adapted, ids, mask)).prefill(num_layers=1)
    early = EarlyExitLlama(tiny_model)
    stepper = Stepper(_call(early, ids, mask))
    logits = stepper.prefill(num_layers=1)
    hidden = tiny_model(ids, output_hidden_states=True).hidden_states[1][:, -1:]
    torch.testing.assert_close(logits, tiny_model.lm_head_logits(hidden)[:, -1].float(), atol=logits_bound(tiny_model, ids),
                               rtol=0)
    stepper.step(torch.tensor([4]))
    assert early.depths == [1, None]


def test_a_passed_cache_holding_the_whole_prompt_is_refused(tiny_model):
    cache = tiny_model.new_cache()
    tiny_model(IDS[:1], past_key_values=cache)
    with pytest.raises(ConfigError, match=r"`past_key_values` already holds 5 positions but `input_ids` has 5"):
        Stepper(_call(tiny_model, IDS[:1], MASK[:1], past_key_values=cache))


class Recorder:
    def __init__(self, fail_at=None):
        self.puts, self.ends, self.fail_at = 0, 0, fail_at

    def put(self, value):
        self.puts += 1
        if self.puts == self.fail_at:
            raise KeyError("streamer failure")

    def end(self):
        self.ends += 1


def test_finish_tracker_ends_the_streamer_on_every_exit_path(tiny_model):
    """Called directly (not through generate), a kit strategy still ends the streamer once."""
    ids = IDS[1:2]
    for fail_at, expect_error in ((None, False), (3, True)):
        streamer = Recorder(fail_at)
        call = _call(tiny_model, ids, None)
        kwargs = dict(logits_processor=call.logits_processor, stopping_criteria=call.stop,
                      generation_config=call.config, streamer=streamer)
        if expect_error:
            with pytest.raises(KeyError):
                greedy_search(tiny_model, ids, **kwargs)
        else:
            greedy_search(tiny_model, ids, **kwargs)
            assert streamer.puts == 1 + 8
        assert streamer.ends == 1


def test_finish_tracker_pads_finished_rows_and_stops(tiny_model):
    call = _call(tiny_model, eos_token_id=7)
    finish = FinishTracker(call)
    seqs = torch.cat([IDS, torch.tensor([[7], [3], [7]])], 1)
    assert finish.update(seqs, None, seqs[:, -1]) is False
    assert finish.unfinished.tolist() == [False, True, False]
    assert finish.pad(torch.tensor([4, 4, 4])).tolist() == [call.pad_token_id, 4, call.pad_token_id]
    seqs = torch.cat([seqs, torch.tensor([[0], [7], [0]])], 1)
    assert finish.update(seqs, None, seqs[:, -1]) is True


def test_the_call_is_frozen_and_checks_its_inputs(tiny_model):
    call = _call(tiny_model)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.config = None  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"unexpected model inputs for my strategy: \['token_type_ids'\]"):
        StrategyCall.from_kwargs("my strategy", tiny_model, IDS, logits_processor=call.logits_processor,
                                 stopping_criteria=call.stop, generation_config=call.config, token_type_ids=IDS)
    with pytest.raises(ConfigError, match="my strategy was called without `generation_config`"):
        StrategyCall.from_kwargs("my strategy", tiny_model, IDS, logits_processor=None, stopping_criteria=None)
    extra = StrategyCall.from_kwargs("x", tiny_model, IDS, accept=("assistant_model",), logits_processor=None,
                                     stopping_criteria=[], generation_config=call.config)
    assert extra.extras == {"assistant_model": None} and extra.stop.max_length == call.config.max_length


def test_stop_conditions_are_data_and_a_criteria_list(tiny_model):
    call = _call(tiny_model, eos_token_id=[7, 9], max_time=100.0)
    stop = call.stop
    assert stop.max_length == IDS.shape[1] + 8 and stop.eos.tolist() == [7, 9]
    assert [type(c).__name__ for c in stop.criteria] == ["MaxTimeCriteria"]
    assert [type(c).__name__ for c in stop] == ["MaxLengthCriteria", "MaxTimeCriteria", "EosTokenCriteria"]
    seqs = torch.tensor([[1, 2, 9], [1, 2, 3]])
    assert stop(seqs).tolist() == [True, False]
    assert StopConditions(max_length=3)(seqs).tolist() == [True, True]


def test_empty_prompt_is_a_clear_error(tiny_model):
    with pytest.raises(ConfigError, match=r"the prompt is empty: `input_ids` has shape \(1, 0\) \(no tokens\)"):
        genkit.generate(tiny_model, torch.zeros((1, 0), dtype=torch.long), max_new_tokens=3)


def test_no_prompt_starts_from_bos_like_transformers(tiny_pair):
    hf, ours = tiny_pair
    ref = hf.generate(max_new_tokens=4, do_sample=False)
    assert torch.equal(genkit.generate(ours, max_new_tokens=4), ref)
