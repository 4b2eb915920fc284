"""Issue 29: the continuous batching manager never loses, duplicates or leaks a request; every
transformers keyword and config field is accepted; limits. References are greedy ``generate`` on
each prompt alone, on the same tiny random model."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch
from test_continuous_batching import _greedy, _prompts

import genkit
from genkit.continuous import ContinuousBatchingConfig, RequestStatus
from genkit.errors import ConfigError, QueueFullError
from genkit.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_llama(seed=1)


def _run_clients(client, n=4, timeout=120):
    threads = [threading.Thread(target=client, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


CB = {"block_size": 8, "num_blocks": 512, "max_batch_tokens": 128}


def _no_cb_thread():
    return not [t for t in threading.enumerate() if t.name == "genkit-continuous-batching"]


def test_mixed_readers_get_every_output_once(model):
    """Streaming and custom-id requests read with request_id_iter while two threads take any output
    with get_result(): every output reaches exactly one reader, every finished one arrives (main
    delivered some outputs twice)."""
    prompts = _prompts(24, seed=3, low=2, high=8)
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    got: list = []
    lock = threading.Lock()
    stop = threading.Event()

    def keep(out):
        with lock:
            got.append(out)

    def any_reader():
        while not stop.is_set():
            out = manager.get_result(timeout=0.05)
            if out is not None:
                keep(out)

    with manager:
        streamed = [manager.add_request(p, max_new_tokens=30, streaming=True, eos_token_id=None) for p in prompts[:16]]
        custom = [manager.add_request(p, request_id=f"mine-{i}", max_new_tokens=30, eos_token_id=None)
                  for i, p in enumerate(prompts[16:])]
        readers = [threading.Thread(target=lambda r=r: [keep(o) for o in manager.request_id_iter(r)])
                   for r in streamed + custom] + [threading.Thread(target=any_reader) for _ in range(2)]
        for t in readers:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(o.is_finished() for o in list(got)) < 24:
            time.sleep(0.02)
        stop.set()
    for t in readers:  # a reader whose outputs another thread took ends when the manager stops
        t.join(60)
    keys = [(o.request_id, len(o.generated_tokens), o.status) for o in got]
    assert len(keys) == len(set(keys)) == 16 * 30 + 8  # none twice, none lost
    finals = {o.request_id: o for o in got if o.is_finished()}
    assert sorted(finals) == sorted(streamed + custom)
    for rid, p in zip(streamed + custom, prompts):
        assert finals[rid].generated_tokens == _greedy(model, p, 30), rid
    assert _no_cb_thread()


def test_requests_cancelled_before_they_are_scheduled_never_finish(model):
    """4 threads add requests and cancel every other one at once (main let some of them finish)."""
    manager = model.init_continuous_batching(continuous_batching_config={**CB, "num_blocks": 1024})
    start = manager.cache.free_blocks
    plan: dict[str, bool] = {}

    def client(worker):
        for j, p in enumerate(_prompts(100, seed=worker, high=20)):
            rid = manager.add_request(p, request_id=f"{worker}-{j}", max_new_tokens=60, eos_token_id=None)
            if j % 2 == 0:
                manager.cancel_request(rid)
            plan[rid] = j % 2 == 0

    with manager:
        _run_clients(client)
        outs = {rid: manager.get_result(rid, timeout=120) for rid in plan}
    for rid, cancelled in plan.items():
        if cancelled:
            assert outs[rid].status == RequestStatus.FAILED and outs[rid].error == "cancelled", rid
            assert outs[rid].finish_reason == "cancelled"
        else:
            assert outs[rid].status == RequestStatus.FINISHED and len(outs[rid].generated_tokens) == 60, rid
    assert manager.cache.free_blocks == start


def _wait_status(manager, rid, status, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = manager.scheduler.active_requests.get(rid)
        if state is not None and state.status == status:
            return True
        time.sleep(0.0005)
    return False


def test_cancel_during_prefill_and_during_decode_frees_blocks(model):
    config = genkit.GenerationConfig(prefill_chunk_size=2)
    manager = model.init_continuous_batching(config, continuous_batching_config={**CB, "max_batch_tokens": 4})
    start = manager.cache.free_blocks
    with manager:
        pre = manager.add_request(_prompts(1, seed=7, low=200, high=200)[0], max_new_tokens=50, eos_token_id=None)
        assert _wait_status(manager, pre, RequestStatus.PREFILLING)
        manager.cancel_request(pre)
        dec = manager.add_request(_prompts(1, seed=8)[0], max_new_tokens=400, eos_token_id=None, streaming=True)
        first = manager.get_result(dec, timeout=30)
        manager.cancel_request(dec)
        rest = list(manager.request_id_iter(dec))
        cancelled_pre = manager.get_result(pre, timeout=30)
    assert first.status == RequestStatus.DECODING
    assert rest[-1].status == RequestStatus.FAILED and rest[-1].error == "cancelled"
    assert 1 <= len(rest[-1].generated_tokens) < 400
    assert cancelled_pre.status == RequestStatus.FAILED and cancelled_pre.generated_tokens == []
    assert manager.cache.free_blocks == start


def test_join_takes_both_call_shapes_and_stop_without_block_then_join_ends_the_thread(model):
    manager = model.init_continuous_batching()
    manager.start()
    manager.join(timeout=0.05)  # genkit's shape: still running
    assert manager.is_running()
    manager.stop(block=False)
    manager.join(time.perf_counter(), timeout=30)  # transformers' shape
    assert not manager.is_running() and _no_cb_thread()
    manager.start()
    manager.stop(block=False)
    manager.join(None, 30)
    assert not manager.is_running() and _no_cb_thread()


def test_flush_stop_finishes_requests_and_hard_stop_fails_them(model):
    prompts = _prompts(4, seed=9)
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    manager.start()
    ids = [manager.add_request(p, max_new_tokens=30, eos_token_id=None) for p in prompts]
    manager.stop(block=True, timeout=60, hard_stop=False)
    outs = [manager.get_result(r, timeout=1) for r in ids]
    assert [o.status for o in outs] == [RequestStatus.FINISHED] * 4
    assert outs[0].generated_tokens == _greedy(model, prompts[0], 30)
    manager.start()
    rid = manager.add_request(prompts[0], max_new_tokens=400, eos_token_id=None)
    manager.stop(block=True, timeout=60)
    out = manager.get_result(rid, timeout=1)
    assert out.status == RequestStatus.FAILED and out.error == "the continuous batching manager stopped"


def test_start_after_a_stop_without_block_runs_again(model):
    prompts = _prompts(3, seed=17)
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    manager.start()
    long = [manager.add_request(p, max_new_tokens=400, eos_token_id=None) for p in prompts[:2]]
    deadline = time.monotonic() + 30
    while len(manager.scheduler.active_requests) < 2 and time.monotonic() < deadline:  # the loop runs them
        time.sleep(0.01)
    manager.stop(block=False)
    manager.start()  # warned "already running" and left the loop to end: nothing ran after it
    try:
        assert manager.is_running()
        out = manager.get_result(manager.add_request(prompts[2], max_new_tokens=5, eos_token_id=None), timeout=60)
        assert out is not None and out.generated_tokens == _greedy(model, prompts[2], 5)
    finally:
        manager.stop(timeout=30)
    assert {manager.get_result(r, timeout=1).error for r in long} == {"the continuous batching manager stopped"}


def test_a_flush_stop_ends_while_requests_keep_coming_and_they_run_after_the_next_start(model):
    prompt = _prompts(1, seed=18)[0]
    manager = model.init_continuous_batching(continuous_batching_config=CB)
    manager.start()
    added, done = [], threading.Event()

    def client():
        while not done.is_set():
            added.append(manager.add_request(prompt, max_new_tokens=30, eos_token_id=None))
            time.sleep(0.001)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        time.sleep(0.2)
        manager.stop(hard_stop=False, timeout=30)  # the flush took every new request: it never ended
        assert not manager.is_running()
    finally:
        done.set()
        thread.join(10)
    finished = {o.request_id for o in iter(lambda: manager.get_result(timeout=0.1), None)}
    later = [rid for rid in added if rid not in finished]
    assert later  # added once the stop was asked: they wait for the next start
    with manager:
        outs = [manager.get_result(rid, timeout=60) for rid in later]
    want = _greedy(model, prompt, 30)
    assert all(o.status == RequestStatus.FINISHED and o.generated_tokens == want for o in outs)
    assert manager.cache.free_blocks == manager.initial_free_blocks


def test_pause_warmup_and_result_handler(model):
    prompt = _prompts(1, seed=10)[0]
    seen = []
    done = threading.Event()
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        manager.warmup()
        assert manager.warmed_up
        rid = manager.add_request(prompt, max_new_tokens=40, eos_token_id=None, streaming=True)
        manager.register_result_handler(rid, lambda out: (seen.append(out), out.is_finished() and done.set()))
        while not seen:
            time.sleep(0.001)
        with manager.pause():
            steps = manager.steps
            time.sleep(0.2)
            assert manager.steps == steps  # no step while paused
        assert done.wait(60)
    assert [len(o.generated_tokens) for o in seen] == list(range(1, 41))
    assert seen[-1].generated_tokens == _greedy(model, prompt, 40)
    with pytest.raises(genkit.errors.InvalidStateError, match="not running"):
        with manager.pause():
            pass


def test_every_transformers_keyword_and_config_is_accepted(model):
    prompts = _prompts(3, seed=11)
    want = [_greedy(model, p, 5) for p in prompts]
    res = model.generate_batch(prompts, max_new_tokens=5, eos_token_id=None, num_q_padding_intervals=4,
                               num_kv_padding_intervals=2, allow_block_sharing=False, persistent_manager=False,
                               warmup=True)
    assert [o.generated_tokens for o in res.values()] == want
    manager = model.init_continuous_batching(None, False, 0, 4, 2, False)  # transformers 5.2's positional order
    assert manager.cache.allow_block_sharing is False
    gpu_only = ContinuousBatchingConfig(use_cuda_graph=True, page_size=16, max_memory_percent=0.5,
                                        varlen_compile_config={"fullgraph": True}, cpu_offload_space=1.0)
    assert gpu_only.block_size == 16 and gpu_only.max_batch_tokens == 512
    import transformers

    theirs = transformers.ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=32,
                                                   scheduler_type="prefill_first")
    for cb in (theirs, {"block_size": 8, "num_blocks": 64}, gpu_only):
        res = model.generate_batch(prompts, continuous_batching_config=cb, max_new_tokens=5, eos_token_id=None)
        assert [o.generated_tokens for o in res.values()] == want
    manager = model.init_continuous_batching(continuous_batching_config=theirs)
    assert (manager.cache.block_size, manager.cache.num_blocks, type(manager.scheduler).__name__) == \
        (8, 64, "PrefillFirstScheduler")
    with pytest.raises(ConfigError, match="`num_q_padding_intervals` must be an int >= 0"):
        model.generate_batch(prompts, num_q_padding_intervals=-1)
    with pytest.raises(ConfigError, match="`max_new_tokenz` is not a generation parameter"):
        model.generate_batch(prompts, max_new_tokenz=5)
    with pytest.raises(ConfigError, match=r"init_continuous_batching\(\) got unknown keyword argument\(s\): bogus"):
        model.init_continuous_batching(bogus=1)
    with pytest.raises(ConfigError, match="`continuous_batching_config` has an unknown key `use_cuda_graphs`"):
        ContinuousBatchingConfig.coerce({"use_cuda_graphs": True})


def test_settings_that_have_no_effect_are_named_in_one_warning(model, caplog):
    prompts = _prompts(2, seed=12)
    with caplog.at_level("WARNING", logger="genkit"):
        model.generate_batch(prompts, max_new_tokens=3, eos_token_id=None,
                             continuous_batching_config={"block_size": 8, "num_blocks": 64})
    assert "no effect" not in caplog.text
    gpu_only = ContinuousBatchingConfig(use_cuda_graph=True, page_size=16, max_memory_percent=0.5,
                                        varlen_compile_config={"fullgraph": True}, cpu_offload_space=1.0)
    with caplog.at_level("WARNING", logger="genkit"):
        model.generate_batch(prompts, max_new_tokens=3, eos_token_id=None, continuous_batching_config=gpu_only)
        model.generate_batch(prompts, max_new_tokens=3, eos_token_id=None, continuous_batching_config=gpu_only)
    lines = [r.getMessage() for r in caplog.records if "no effect in genkit" in r.getMessage()]
    assert len(lines) == 1, lines  # once per process
    assert lines[0].startswith("continuous_batching_config: `max_memory_percent`, `use_cuda_graph`, "
                               "`varlen_compile_config`, `cpu_offload_space` have no effect in genkit (")
    assert "page_size" not in lines[0] and "CUDA graphs" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="genkit"):
        model.init_continuous_batching(num_q_padding_intervals=4, workload_hints={"max_prompt_length": 64})
    assert "`num_q_padding_intervals` has no effect in genkit" in caplog.text
    assert "`num_kv_padding_intervals`" not in caplog.text  # left at 0
    assert "`workload_hints` has no effect in genkit" in caplog.text


def test_persistent_manager_is_kept_by_the_model(model):
    prompts = _prompts(2, seed=12)
    model.generate_batch(prompts, max_new_tokens=3, persistent_manager=True, continuous_batching_config=CB)
    kept = model._cached_continuous_batching_manager
    assert model.init_continuous_batching() is kept and not kept.is_running()
    res = model.generate_batch(prompts, max_new_tokens=3, eos_token_id=None)
    assert [o.generated_tokens for o in res.values()] == [_greedy(model, p, 3) for p in prompts]
    model.destroy_cached_continuous_batching_manager()
    assert not hasattr(model, "_cached_continuous_batching_manager")


def test_seed_field_makes_sampling_reproducible(model):
    prompts = _prompts(4, seed=13)
    kw = {"max_new_tokens": 8, "do_sample": True, "temperature": 1.5}
    a = model.generate_batch(prompts, continuous_batching_config={"seed": 5}, **kw)
    b = model.generate_batch(prompts, continuous_batching_config={"seed": 5}, **kw)
    c = model.generate_batch(prompts, continuous_batching_config={"seed": 6}, **kw)
    tokens = [[o.generated_tokens for o in r.values()] for r in (a, b, c)]
    assert tokens[0] == tokens[1] != tokens[2]


def test_limits_context_cap_cache_fit_and_queue_size(model, caplog):
    context = model.config.max_position_embeddings
    prompt = _prompts(1, seed=14, low=context - 6, high=context - 6)[0]
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        past = manager.get_result(manager.add_request(prompt, max_new_tokens=50, eos_token_id=None), timeout=60)
        capped = manager.get_result(manager.add_request(prompt, eos_token_id=None), timeout=60)  # the default, 20
        small = manager.get_result(manager.add_request(prompt[:10], max_new_tokens=5, eos_token_id=None), timeout=60)
    # past the context: generate's error (it was capped at 6 tokens, where generate refuses)
    with pytest.raises(ConfigError) as refused:
        model.generate(torch.tensor([prompt]), max_new_tokens=50, eos_token_id=None)
    assert past.status == RequestStatus.FAILED and past.error == str(refused.value)
    assert "ask for at most 6 new tokens" in past.error
    # the default length is capped by the context, as generate caps it
    assert capped.status == RequestStatus.FINISHED and capped.max_new_tokens == 6
    assert capped.generated_tokens == _greedy(model, prompt, 6) and small.max_new_tokens == 5
    manager = model.init_continuous_batching(continuous_batching_config={"block_size": 8, "num_blocks": 4})
    out = manager.get_result(manager.add_request(prompt[:20], max_new_tokens=20), timeout=1)
    assert out.status == RequestStatus.FAILED and "can never fit the cache, which holds 32 tokens" in out.error
    manager = model.init_continuous_batching(max_queue_size=2)
    manager.add_request(prompt[:5])
    manager.add_request(prompt[:5])
    with pytest.raises(QueueFullError, match=r"request 'req_2': 2 requests are waiting, the most `max_queue_size` "
                                             r"allows \(2\)"):
        manager.add_request(prompt[:5])
    with manager:  # a full queue took no id
        assert manager.get_result("req_0", timeout=60).is_finished()
        deadline = time.monotonic() + 30
        while manager.scheduler.waiting_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.add_request(prompt[:5]) == "req_2"
    with caplog.at_level(logging.WARNING, logger="genkit.continuous"):
        model.init_continuous_batching(genkit.GenerationConfig(compile_config={"fullgraph": True}))
    assert "`compile_config` has no effect on continuous batching" in caplog.text


def test_a_request_id_in_use_is_refused_and_generated_ids_skip_it(model):
    first, other = _prompts(2, seed=15, low=12, high=12)
    manager = model.init_continuous_batching(manual_eviction=True, continuous_batching_config=CB)
    start = manager.cache.free_blocks
    assert manager.add_request(first, request_id="req_0", max_new_tokens=6, eos_token_id=None) == "req_0"
    with pytest.raises(ConfigError, match=r"`request_id` 'req_0' is in use: a request with that id is still running; "
                                          r"give another id"):
        manager.add_request(other, request_id="req_0", max_new_tokens=6)
    assert manager.add_request(other, max_new_tokens=6, eos_token_id=None) == "req_1"  # req_0 is taken
    with manager:
        outs = {rid: manager.get_result(rid, timeout=60) for rid in ("req_0", "req_1")}
        assert outs["req_0"].prompt_ids == first and outs["req_0"].generated_tokens == _greedy(model, first, 6)
        assert outs["req_1"].prompt_ids == other and outs["req_1"].generated_tokens == _greedy(model, other, 6)
        with pytest.raises(ConfigError, match=r"a request with that id keeps its cache blocks \(manual_eviction\): "
                                              r"evict_request_from_cache\('req_0'\) first"):
            manager.add_request(other, request_id="req_0", max_new_tokens=6)
        for rid in outs:
            manager.evict_request_from_cache(rid)
        deadline = time.monotonic() + 10
        while manager.cache.free_blocks != start and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.cache.free_blocks == start  # the first request's blocks were lost to the second
        again = manager.get_result(manager.add_request(other, request_id="req_0", max_new_tokens=6,
                                                       eos_token_id=None), timeout=60)
        assert again.generated_tokens == outs["req_1"].generated_tokens
        refused = manager.add_request(other, request_id="bad", max_new_tokens=0)  # fails on arrival: id free
        assert manager.get_result(refused, timeout=5).status == RequestStatus.FAILED
        assert manager.get_result(manager.add_request(other, request_id="bad", max_new_tokens=2), timeout=60).status \
            == RequestStatus.FINISHED


def test_a_requests_own_prefill_chunk_size_applies_and_its_own_batching_config_is_refused(model, caplog):
    prompt = _prompts(1, seed=16, low=40, high=40)[0]
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        out = manager.get_result(manager.add_request(prompt, max_new_tokens=2, eos_token_id=None,
                                                     prefill_chunk_size=4), timeout=60)
        assert out.generated_tokens == _greedy(model, prompt, 2)
        assert manager.steps == 40 // 4 + 1  # was 2: the prompt in one step, the setting dropped
        refused = manager.get_result(manager.add_request(prompt, continuous_batching_config={"block_size": 2}),
                                     timeout=5)
        assert refused.status == RequestStatus.FAILED and refused.error == (
            f"request {refused.request_id!r}: `continuous_batching_config` configures the manager "
            "(init_continuous_batching / generate_batch's continuous_batching_config=), not one request")
        with caplog.at_level(logging.WARNING, logger="genkit.continuous"):
            rid = manager.add_request(prompt, max_new_tokens=1, compile_config={"fullgraph": True})
        assert manager.get_result(rid, timeout=60).status == RequestStatus.FINISHED
    assert f"request {rid!r}: `compile_config` has no effect on continuous batching" in caplog.text


def test_soak_1000_requests_4_threads_cancelled_at_random_moments(model):
    """1,000 requests from 4 threads, 10% cancelled before scheduling, during prefill or during
    decode; results read through get_result(id), request_id_iter and iteration at once."""
    pool = _prompts(200, seed=21, low=4, high=60)  # most prompts new: the prompt cache leaves prefills to cancel
    refs = [_greedy(model, p, 12) for p in pool]
    config = genkit.GenerationConfig(prefill_chunk_size=8)
    manager = model.init_continuous_batching(config, continuous_batching_config={**CB, "max_batch_tokens": 96})
    start = manager.cache.free_blocks
    plan: dict[str, tuple[int, int]] = {}
    cancelled: set[str] = set()
    finals: dict[str, list] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def keep(out):
        if out is not None and out.is_finished():
            with lock:
                finals.setdefault(out.request_id, []).append(out)

    def client(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for chunk in range(25):
                ids = [f"w{worker}-{chunk}-{j}" for j in range(10)]
                for j, rid in enumerate(ids):
                    k, n = rng.randrange(len(pool)), rng.randint(1, 12)
                    with lock:
                        plan[rid] = (k, n)
                    manager.add_request(pool[k], request_id=rid, max_new_tokens=n, eos_token_id=None,
                                        streaming=j % 3 == 1)
                for rid in ids:
                    if rng.random() < 0.1:
                        time.sleep(rng.choice([0, 0.0005, 0.002, 0.005]))
                        with lock:
                            cancelled.add(rid)
                        manager.cancel_request(rid)
                for j, rid in enumerate(ids):  # j % 3 == 2: read by the main thread's iteration
                    if j % 3 == 0:
                        keep(manager.get_result(rid, timeout=60))
                    elif j % 3 == 1:
                        for out in manager.request_id_iter(rid):
                            keep(out)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with manager:
        _run_clients(client)
        for out in manager:
            keep(out)
            if len(finals) == len(plan):
                break
    assert not errors
    assert len(plan) == 1000 and set(finals) == set(plan)
    assert all(len(v) == 1 for v in finals.values())  # nothing duplicated
    phases = {"before": 0, "prefill": 0, "decode": 0}
    for rid, (k, n) in plan.items():
        out = finals[rid][0]
        if out.status == RequestStatus.FAILED:
            assert rid in cancelled and out.error == "cancelled", rid
            phases["decode" if out.generated_tokens else "prefill" if out.lifespan[0] > 0 else "before"] += 1
        else:
            assert out.status == RequestStatus.FINISHED and out.generated_tokens == refs[k][:n], rid
    assert 50 <= len(cancelled) <= 150 and all(phases.values()), phases
    assert manager.cache.free_blocks == start and manager.scheduler.active_requests == {}
    assert _no_cb_thread()
