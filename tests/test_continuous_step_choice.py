"""Issue 32, serve scheduling: a continuous-batching step chooses the tokens of all its plain greedy
requests with one argmax (``genkit.strategy.sampling.argmax_rows``) and decides their finish from
plain values (``genkit.strategy.finish.eos_or_length``); a step's streamed outputs reach their
readers at once (``OutputRouter.deliver_all`` / ``take_all``). Tokens and finish reasons stay those of
greedy ``generate`` on each prompt alone; a request arriving while others decode gets its first token
in the step after the one in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_continuous_batching import _greedy, _prompts

from genkit.continuous import ContinuousBatchingConfig, GenerationOutput, RequestStatus
from genkit.continuous.outputs import OutputRouter
from genkit.models.tiny import tiny_llama
from genkit.strategy.call import StopConditions
from genkit.strategy.finish import eos_or_length, finish_codes, reason_names
from genkit.strategy.sampling import argmax_rows

CB = ContinuousBatchingConfig(block_size=8, num_blocks=256, max_batch_tokens=128)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=1)


def test_argmax_rows_is_torch_argmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1000, generator=g)
    x[1, 10] = x[1, 500] = x[1].max() + 1  # a tie: the first maximum
    x[2, 3] = float("nan")  # a NaN counts as the maximum
    x[2, 9] = float("nan")
    x[3] = float("-inf")
    x[4, 999] = float("inf")
    for scores in (x, x.double(), x[:, ::2], x[0], x.bfloat16()):
        got = argmax_rows(scores)
        assert got.dtype == torch.long and got.shape == scores.shape[:-1]
        assert torch.equal(got, scores.argmax(dim=-1))
    assert argmax_rows(x).tolist()[1:5] == [10, 3, 0, 999]


def test_eos_or_length_is_finish_codes():
    eos = torch.tensor([5, 9])
    for stop in (StopConditions(max_length=6, eos=eos), StopConditions(max_length=6), StopConditions(max_length=4)):
        for length in (4, 5, 6, 7):
            for token in (1, 5, 9):
                sequences = torch.full((1, length), 2)
                sequences[0, -1] = token
                ref = reason_names(finish_codes(stop, sequences, None, torch.tensor([token])))[0]
                assert eos_or_length(stop, length, token) == ref, (stop, length, token)
    with pytest.raises(ValueError, match="without criteria"):
        eos_or_length(StopConditions(max_length=6, criteria=(lambda ids, scores: False,)), 3, 1)


def _greedy_until(model, prompt, n, eos):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def test_a_step_of_plain_and_processed_requests_gives_generates_tokens_and_reasons(model):
    """Plain greedy requests (one argmax for the step) beside requests with a logits processor or
    log-probabilities (chosen one by one) in the same steps: every request's tokens and finish
    reason are greedy generate's, EOS ones included."""
    prompts = _prompts(12, seed=5, low=2, high=12)
    eos = [_greedy(model, p, 6)[3] for p in prompts]  # a token each greedy run meets: it stops there
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    with manager:
        rids = []
        for i, (p, e) in enumerate(zip(prompts, eos)):
            extra = {"repetition_penalty": 1.3} if i % 3 == 1 else {"top_logprobs": 2} if i % 3 == 2 else {}
            rids.append(manager.add_request(p, max_new_tokens=10, eos_token_id=e if i % 2 else None,
                                            streaming=i % 4 == 0, **extra))
        outs = {}
        while len(outs) < len(rids):
            out = manager.get_result(timeout=60)
            assert out is not None
            if out.is_finished():
                outs[out.request_id] = out
    assert manager.steps < sum(len(p) + 10 for p in prompts)  # requests shared steps
    for i, (rid, p, e) in enumerate(zip(rids, prompts, eos)):
        kwargs = {"repetition_penalty": 1.3} if i % 3 == 1 else {}
        ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                             eos_token_id=e if i % 2 else None, **kwargs)[0, len(p):].tolist()
        out = outs[rid]
        assert out.status == RequestStatus.FINISHED
        assert out.generated_tokens == ref, i
        stopped = i % 2 and ref[-1] == e
        assert out.finish_reason == ("eos" if stopped else "length"), i
        if i % 3 == 2:
            assert len(out.logprobs) == len(ref) and len(out.top_logprobs[0]) == 2


def test_deliver_all_keeps_order_and_handlers():
    router = OutputRouter(lambda: True)
    seen = []
    router.set_handler("h", seen.append)
    outs = [GenerationOutput("a", generated_tokens=[1]), GenerationOutput("h", generated_tokens=[7]),
            GenerationOutput("b", generated_tokens=[2]), GenerationOutput("a", generated_tokens=[1, 3])]
    router.deliver_all(outs)
    assert [o.generated_tokens for o in seen] == [[7]]
    assert router.take_all(timeout=1) == [outs[0], outs[2], outs[3]]
    assert router.take_all(timeout=0.05) == []
    router.deliver_all([GenerationOutput("a", generated_tokens=[1, 3, 4])])
    assert router.take("a", timeout=1).generated_tokens == [1, 3, 4]
    assert router.empty()


def test_take_all_wakes_on_a_delivery_from_another_thread():
    router = OutputRouter(lambda: True)
    got = []
    reader = threading.Thread(target=lambda: got.extend(router.take_all(timeout=30)))
    reader.start()
    time.sleep(0.05)
    router.deliver_all([GenerationOutput("x"), GenerationOutput("y")])
    reader.join(30)
    assert [o.request_id for o in got] == ["x", "y"]  # the step's outputs in one take


def _reader(router, seen, pause_after, progress, stop):
    """A thread's loop reading every output (as ``genkit serve``'s dispatcher does) until ``stop`` is
    set; after taking output number n (from 1) it works ``pause_after[n]`` seconds before it waits
    again. ``seen``: [output, ``progress()`` when it was taken, ``progress()`` when the work was done]."""
    def run():
        while not stop.is_set():
            for out in router.take_all(timeout=0.5):  # (rarely between two waits: a delivery finds it waiting)
                seen.append([out, progress(), None])
                time.sleep(pause_after.get(len(seen), 0))
                seen[-1][2] = progress()
    return run


def _until_a_reader_waits(router, deadline):
    while router._waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.001)


def test_yield_to_readers_waits_until_a_waiting_reader_took_the_outputs_and_waits_again():
    router = OutputRouter(lambda: True)
    assert router.yield_to_readers(timeout=5) is False  # no reader waits: at once
    got, taken = [], threading.Event()

    def read():
        got.extend(router.take_all(timeout=30))
        time.sleep(0.2)  # the reader's work on them: the yielding thread waits through it
        taken.set()
        router.take_all(timeout=0.5)  # waits again
    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    _until_a_reader_waits(router, deadline)
    router.deliver_all([GenerationOutput("x", generated_tokens=[4])])
    start = time.monotonic()
    assert router.yield_to_readers(timeout=30) is True
    assert taken.is_set() and [o.request_id for o in got] == ["x"] and time.monotonic() - start >= 0.15
    reader.join(30)
    # a reader waits, but the output went to a handler: nothing to yield for
    router.set_handler("h", lambda out: None)
    reader = threading.Thread(target=lambda: router.take_all(timeout=0.5))
    reader.start()
    _until_a_reader_waits(router, deadline)
    router.deliver_all([GenerationOutput("h", generated_tokens=[1])])
    start = time.monotonic()
    assert router.yield_to_readers(timeout=5) is False and time.monotonic() - start < 0.1
    reader.join(30)


def test_the_loop_waits_for_the_reader_of_a_first_token_before_its_next_step_and_only_then(model):
    """A streamed request's first token: the manager's next step waits until the thread reading the
    outputs has taken it and waits again (it gives that thread its core, genkit serve's time to first
    token); later tokens are not waited for. The tokens are greedy generate's."""
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    manager.output_router.yield_timeout = 30.0  # (the reader's pauses decide, not the default 2 ms)
    prompt, seen = [5, 17, 33, 8], []
    stop = threading.Event()
    progress = lambda: manager.steps + manager.solo.tokens  # noqa: E731  (steps, and tokens decoded alone)
    reader = threading.Thread(target=_reader(manager.output_router, seen, {1: 0.3, 3: 0.3}, progress, stop))
    with manager:
        reader.start()
        deadline = time.monotonic() + 30
        _until_a_reader_waits(manager.output_router, deadline)
        manager.add_request(prompt, request_id="A", max_new_tokens=12, streaming=True, eos_token_id=None)
        while not (seen and seen[-1][0].is_finished()) and time.monotonic() < deadline:
            time.sleep(0.01)
    stop.set()
    reader.join(30)
    first, third = seen[0], seen[2]
    assert len(first[0].generated_tokens) == 1 and first[2] == first[1]  # no step while the reader held it
    assert len(third[0].generated_tokens) == 3 and third[2] > third[1]  # a later token: the steps went on
    assert seen[-1][0].generated_tokens == _greedy(model, prompt, 12)


def test_a_request_arriving_while_others_decode_gets_its_first_token_after_at_most_one_step(model):
    """Request B arrives while A decodes: between B's arrival and its first token A makes at most
    two tokens (the step in flight, then the step B's prompt rides with A's token); B's tokens are
    greedy generate's."""
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    a_prompt, b_prompt = [5, 17, 33, 8], [9, 4, 71, 12, 30, 2]
    with manager:
        manager.add_request(a_prompt, request_id="A", max_new_tokens=60, streaming=True, record_timestamps=True,
                            eos_token_id=None)
        for out in manager.request_id_iter("A", timeout=60):
            if len(out.generated_tokens) >= 5:
                break
        manager.add_request(b_prompt, request_id="B", max_new_tokens=8, streaming=True, record_timestamps=True,
                            eos_token_id=None)
        first_b = manager.get_result("B", timeout=60)
        b_outputs = [first_b] + list(manager.request_id_iter("B", timeout=60))
        a_last = None
        for out in manager.request_id_iter("A", timeout=60):
            a_last = out
    assert first_b is not None and len(first_b.generated_tokens) == 1
    arrived, first = first_b.created_time, first_b.timestamps[0]
    a_tokens_between = [t for t in a_last.timestamps if arrived < t <= first]
    assert 1 <= len(a_tokens_between) <= 2
    assert b_outputs[-1].generated_tokens == _greedy(model, b_prompt, 8)
    assert a_last.generated_tokens == _greedy(model, a_prompt, 60)
