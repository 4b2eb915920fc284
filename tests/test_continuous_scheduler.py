"""Issue 29: the public scheduler API (transformers' ``Scheduler``, ``FIFOScheduler``,
``PrefillFirstScheduler``), schedulers as plugins (``register_schedulers``), ``ContinuousMixin``.

Scheduler tests drive a scheduler by hand over a real block allocator; the pack test pip-installs a
scheduler pack into a private folder and runs it through its entry point in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import genkit
from genkit.continuous import ContinuousBatchingConfig, RequestState, RequestStatus
from genkit.continuous.block_allocator import BlockAllocator
from genkit.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
PACK = REPO / "tests" / "fixtures" / "genkit-spf-scheduler-pack"
MARK = "@@RESULT@@"


def _state(rid: str, n: int, order: int) -> RequestState:
    """A request of ``n`` prompt tokens, none shared with another order's (no prompt waits for another's)."""
    return RequestState(rid, list(range(3 + 1000 * order, 3 + 1000 * order + n)), 4, None, None, None, order=order)


def _scheduler(cls, num_blocks=16, **kw):
    return cls(BlockAllocator(block_size=4, num_blocks=num_blocks), max_requests_per_batch=8, **kw)


def test_the_public_names_are_exported_like_transformers():
    from genkit.continuous import FIFOScheduler, PrefillFirstScheduler, Scheduler

    assert genkit.Scheduler is Scheduler and genkit.FIFOScheduler is FIFOScheduler
    assert genkit.PrefillFirstScheduler is PrefillFirstScheduler
    assert issubclass(FIFOScheduler, Scheduler) and issubclass(PrefillFirstScheduler, Scheduler)
    for name in ("add_waiting_request", "clear_cancelled_requests", "finish_request",
                 "get_active_request_static_outputs", "has_pending_requests", "request_is_cancelled",
                 "schedule_batch", "set_request_cancellation"):
        assert callable(getattr(Scheduler, name)), name
    with pytest.raises(TypeError, match="abstract"):
        Scheduler(BlockAllocator(block_size=4, num_blocks=4))
    from genkit.models.llama import LlamaForCausalLM

    assert issubclass(LlamaForCausalLM, genkit.ContinuousMixin)
    assert {"generate_batch", "init_continuous_batching", "continuous_batching_context_manager",
            "destroy_cached_continuous_batching_manager"} <= set(vars(genkit.ContinuousMixin))


def test_fifo_decodes_first_and_keeps_a_safety_margin():
    s = _scheduler(genkit.FIFOScheduler)
    assert s.safety_margin == 0.2 and not s.has_pending_requests()
    a, b, c = _state("a", 6, 0), _state("b", 30, 1), _state("c", 12, 2)
    s.add_waiting_request(a)
    plan = s.schedule_batch(token_budget=64)
    assert [(r.request_id, n) for r, n in plan] == [("a", 6)] and s.active_requests == {"a": a}
    a.cached, a.status = 6, RequestStatus.DECODING
    a.generated.append(9)
    assert s.get_active_request_static_outputs("a") == [9] and s.get_active_request_static_outputs("x") == []
    s.add_waiting_request(b)
    s.add_waiting_request(c)
    plan = s.schedule_batch(token_budget=64)
    # the decoding request first; b (8 blocks) leaves 6 free, c (3 blocks) would leave 3 < 0.2 * 16
    assert [(r.request_id, n) for r, n in plan] == [("a", 1), ("b", 30)]
    assert list(s.waiting_requests_order) == ["c"] and s.has_pending_requests()
    held = 16 - s.cache.free_blocks
    s.finish_request("b")
    assert 16 - s.cache.free_blocks == held - 8 and "b" not in s.active_requests


def test_prefill_first_runs_prompts_before_decodes():
    s = _scheduler(genkit.PrefillFirstScheduler)
    assert s.safety_margin == 0.0
    a, b = _state("a", 3, 0), _state("b", 5, 1)
    s.add_waiting_request(a)
    s.schedule_batch(token_budget=64)
    a.cached, a.status = 3, RequestStatus.DECODING
    a.generated.append(9)
    s.add_waiting_request(b)
    assert [(r.request_id, n) for r, n in s.schedule_batch(token_budget=64)] == [("b", 5), ("a", 1)]
    assert genkit.FIFOScheduler(BlockAllocator(block_size=4, num_blocks=4), safety_margin=0.5).safety_margin == 0.5
    for bad in (2, 1, True):  # 1 would keep the whole cache free: nothing admitted, ever
        with pytest.raises(ConfigError, match=rf"`safety_margin` must be a number in \[0, 1\) or None; got {bad}"):
            genkit.FIFOScheduler(BlockAllocator(block_size=4, num_blocks=4), safety_margin=bad)
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.safety_margin` must be a number in \[0, 1\) or None"):
        genkit.ContinuousBatchingConfig(safety_margin=True)


def test_cancellation_marks_free_blocks_and_wait_for_late_requests():
    s = _scheduler(genkit.FIFOScheduler)
    a, b = _state("a", 9, 0), _state("b", 2, 1)
    s.add_waiting_request(a)
    s.add_waiting_request(b)
    s.schedule_batch(token_budget=64)
    assert s.cache.free_blocks == 16 - 3 - 1
    s.set_request_cancellation("a")
    s.set_request_cancellation("late")  # its request has not reached the scheduler yet
    assert s.request_is_cancelled("a") and s.request_is_cancelled("late") and not s.request_is_cancelled("b")
    assert [r.request_id for r in s.clear_cancelled_requests()] == ["a"]
    assert s.cache.free_blocks == 16 - 1 and a.blocks == []
    late = _state("late", 4, 2)
    s.add_waiting_request(late)
    assert [r.request_id for r in s.clear_cancelled_requests()] == ["late"]
    assert "late" not in s.waiting_requests and s.clear_cancelled_requests() == []


@pytest.mark.parametrize("cls", [genkit.FIFOScheduler, genkit.PrefillFirstScheduler])
def test_prefilling_requests_that_fill_the_cache_do_not_wait_on_each_other(cls):
    # two 12-token prompts in chunks of 4 over a 16-token cache: each alone fits, but once both
    # hold 8 tokens no free block is left; the older one preempts the newer (which recomputes later)
    s = _scheduler(cls, num_blocks=4, prefill_chunk_size=4)
    a, b = _state("a", 12, 0), _state("b", 12, 1)
    s.add_waiting_request(a)
    s.add_waiting_request(b)
    for _ in range(2):
        assert [(r.request_id, n) for r, n in s.schedule_batch(token_budget=8)] == [("a", 4), ("b", 4)]
        a.cached += 4
        b.cached += 4
    assert s.cache.free_blocks == 0
    plan = [(r.request_id, n) for r, n in s.schedule_batch(token_budget=8)]
    assert plan[0] == ("a", 4) and len(a.blocks) == 3 and s.preempted == 1 and b.cached == 0
    if cls is genkit.FIFOScheduler:  # b waits: admitting it again would leave no block free
        assert plan == [("a", 4)] and list(s.waiting_requests_order) == ["b"] and b.blocks == []
    else:  # prefill_first (no margin) admits b again, from its start, into the block left
        assert plan == [("a", 4), ("b", 4)] and len(b.blocks) == 1


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
def test_a_full_cache_of_split_prefills_still_finishes_every_request(tiny_model, scheduler):
    import torch

    cb = ContinuousBatchingConfig(block_size=4, num_blocks=4, max_batch_tokens=8, scheduler_type=scheduler)
    config = genkit.GenerationConfig(prefill_chunk_size=4, continuous_batching_config=cb.to_dict())
    prompts = [list(range(3, 15)), list(range(20, 32))]
    with tiny_model.init_continuous_batching(config) as manager:
        ids = [manager.add_request(p, max_new_tokens=2, do_sample=False, eos_token_id=None) for p in prompts]
        outs = [manager.get_result(i, timeout=30) for i in ids]  # a deadlock gave None after the timeout
    for out, prompt in zip(outs, prompts):
        ref = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False, eos_token_id=None)
        assert out is not None and out.generated_tokens == ref[0, len(prompt):].tolist()
    assert manager.cache.free_blocks == 4


def test_scheduler_type_and_scheduler_pick_a_registered_or_given_class(tiny_model):
    class LastInFirstOut(genkit.FIFOScheduler):
        def waiting_candidates(self):
            return super().waiting_candidates()[::-1]

    assert ContinuousBatchingConfig(scheduler="prefill_first").scheduler_type == "prefill_first"
    manager = tiny_model.init_continuous_batching(continuous_batching_config={"scheduler": LastInFirstOut,
                                                                              "num_blocks": 64, "block_size": 8})
    assert type(manager.scheduler) is LastInFirstOut
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.scheduler` must be 'fifo' or "
                                          r"'prefill_first', a genkit.Scheduler subclass or None; got 'lifo'"):
        ContinuousBatchingConfig(scheduler="lifo")  # named scheduler_type, which the caller did not set
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.scheduler_type` must be 'fifo' or "
                                          r"'prefill_first'; got 'lifo'"):
        ContinuousBatchingConfig(scheduler_type="lifo")
    with pytest.raises(ConfigError, match=r"`continuous_batching_config.scheduler` must be a registered scheduler "
                                          r"name, a genkit.Scheduler subclass or None; got <class 'int'>"):
        ContinuousBatchingConfig(scheduler=int)
    reg = genkit.get_registry()
    assert {"fifo", "prefill_first"} <= set(reg.items["scheduler"])
    assert reg.get("scheduler", "fifo").load() is genkit.FIFOScheduler


@pytest.fixture(scope="module")
def spf_site(tmp_path_factory):
    dest = tmp_path_factory.mktemp("spf")
    src = dest / "src"
    shutil.copytree(PACK, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = dest / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(site), str(src)],
                   check=True, capture_output=True, text=True)
    return site


def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("GENKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, env=env, capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))


RUN_PACK = r'''
import json
import torch
import genkit
from genkit.models.tiny import tiny_llama

torch.set_num_threads(1)
model = tiny_llama(seed=1)
lengths = [30, 5, 22, 2, 14, 9]
prompts = [[3 + (7 * i + j) % 100 for j in range(n)] for i, n in enumerate(lengths)]
out = {}
for name in ("fifo", "shortest_prompt_first"):
    cb = {"scheduler_type": name, "max_requests_per_batch": 1, "block_size": 8, "num_blocks": 64}
    res = model.generate_batch(prompts, max_new_tokens=4, eos_token_id=None, continuous_batching_config=cb)
    order = sorted(res, key=lambda rid: res[rid].lifespan[1])
    out[name] = {"order": [len(res[r].prompt_ids) for r in order],
                 "tokens": [res[r].generated_tokens for r in res]}
out["greedy"] = [model.generate(torch.tensor([p]), max_new_tokens=4, eos_token_id=None)[0, len(p):].tolist()
                 for p in prompts]
out["origin"] = str(genkit.get_registry().get("scheduler", "shortest_prompt_first").origin)
print("@@RESULT@@" + json.dumps(out))
'''


def test_a_pack_scheduler_installed_by_entry_point_changes_the_finish_order(spf_site):
    proc = _run(RUN_PACK, spf_site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith(MARK))[len(MARK):])
    assert out["origin"] == "genkit-spf-scheduler@0.1.0 (spf)"
    # one request at a time, all queued before the first step: arrival order, then shortest prompt first
    assert out["fifo"]["order"] == [30, 5, 22, 2, 14, 9]
    assert out["shortest_prompt_first"]["order"] == [2, 5, 9, 14, 22, 30]
    assert out["fifo"]["tokens"] == out["shortest_prompt_first"]["tokens"] == out["greedy"]


def test_genkit_plugins_lists_the_pack_scheduler(spf_site):
    proc = _run("import sys; from genkit.cli import main; sys.exit(main(['plugins', '--json']))", spf_site)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    by_name = {p["name"]: p for p in report["plugins"]}
    assert by_name["spf"]["items"] == {"scheduler": ["shortest_prompt_first"]}
    assert "register_schedulers" in by_name["spf"]["hooks"]
    assert by_name["builtin"]["items"]["scheduler"] == ["fifo", "prefill_first"]


def test_a_scored_prompt_runs_in_chunks_of_its_logits_budget():
    """A request whose prompt is scored (``prompt_top`` set) computes at most ``score_chunk`` prompt
    tokens a step (each position's logits are kept), then decodes one token a step; it shares no
    cached prefix."""
    s = _scheduler(genkit.FIFOScheduler)
    r = _state("r", 10, 0)
    r.prompt_top, r.score_chunk = 1, 3
    s.add_waiting_request(r)
    chunks = []
    for _ in range(5):
        (state, n), = s.schedule_batch(token_budget=64)
        chunks.append(n)
        state.cached += n
        if state.cached == len(state.prompt_ids):
            state.generated.append(5)
            state.status = RequestStatus.DECODING
    assert chunks == [3, 3, 3, 1, 1]


def test_scored_prompts_share_one_logits_budget_per_step():
    """Scored prompts in one step compute ``score_chunk`` positions between them (the step's logits
    stay within one logits budget): the second gets what the first leaves, and one that gets
    nothing waits (in FIFO order, with the requests behind it)."""
    s = _scheduler(genkit.FIFOScheduler, num_blocks=64)
    a, b, c = _state("a", 3, 0), _state("b", 10, 1), _state("c", 10, 2)
    for r in (a, b, c):
        r.prompt_top, r.score_chunk = 0, 4
        s.add_waiting_request(r)
    plan = s.schedule_batch(token_budget=64)
    assert [(r.request_id, n) for r, n in plan] == [("a", 3), ("b", 1)]


def _prompted(rid: str, prompt: list[int], order: int, top: int | None = None) -> RequestState:
    state = RequestState(rid, prompt, 4, None, None, None, order=order)
    state.prompt_top = top
    return state


@pytest.mark.parametrize("cls", [genkit.FIFOScheduler, genkit.PrefillFirstScheduler])
def test_a_request_waits_for_a_prefix_another_is_computing(cls):
    """Requests queued together that share most of their prompt: the first computes it, the second
    waits (the third, sharing nothing, runs at once) and takes it from the prompt cache once the
    first publishes it."""
    s = _scheduler(cls, num_blocks=32)
    context = list(range(100, 112))
    a, b, c = _prompted("a", context + [7], 0), _prompted("b", context + [8], 1), _prompted("c", [50, 51, 52], 2)
    for r in (a, b, c):
        s.add_waiting_request(r)
    assert [r.request_id for r, _ in s.schedule_batch(token_budget=64)] == ["a", "c"]
    a.cached, a.status, c.cached, c.status = 13, RequestStatus.DECODING, 3, RequestStatus.DECODING
    s.cache.publish(a.prompt_ids, a.blocks, 13)
    plan = s.schedule_batch(token_budget=64)
    assert ("b", 1) in [(r.request_id, n) for r, n in plan] and b.cached == b.from_cache == 12


@pytest.mark.parametrize("other, state, waits", [
    (dict(prompt=list(range(100, 112)) + [7]), dict(prompt=list(range(100, 112)) + [8]), True),
    # sharing less than half its prompt (a long system prompt's requests compute their own messages)
    (dict(prompt=list(range(100, 106)) + [7] * 8), dict(prompt=list(range(100, 106)) + [8] * 8), False),
    # sharing less than a block (4 tokens here)
    (dict(prompt=[100, 101, 102, 7]), dict(prompt=[100, 101, 102, 8]), False),
    # the other's prompt left to compute is more than twice this one
    (dict(prompt=list(range(100, 112)) + [7] * 40), dict(prompt=list(range(100, 112)) + [8]), False),
    # a scored prompt waits only for scores with as many alternatives
    (dict(prompt=list(range(100, 112)) + [7]), dict(prompt=list(range(100, 112)) + [8], top=1), False),
    (dict(prompt=list(range(100, 112)) + [7], top=1), dict(prompt=list(range(100, 112)) + [8], top=2), False),
    (dict(prompt=list(range(100, 112)) + [7], top=2), dict(prompt=list(range(100, 112)) + [8], top=1), True),
    (dict(prompt=list(range(100, 112)) + [7], top=2), dict(prompt=list(range(100, 112)) + [8]), True),
], ids=["shares-most", "less-than-half", "less-than-a-block", "other-too-long", "unscored-other",
        "fewer-alternatives", "more-alternatives", "unscored-waits-for-scored"])
def test_which_requests_wait_for_a_prefix(other, state, waits):
    s = _scheduler(genkit.FIFOScheduler, num_blocks=64)
    first = _prompted("a", other["prompt"], 0, other.get("top"))
    s.add_waiting_request(first)
    s.schedule_batch(token_budget=4)  # admitted, its prompt still being computed
    assert first.status == RequestStatus.PREFILLING
    assert s.awaits_prefix(_prompted("b", state["prompt"], 1, state.get("top"))) is waits


def test_no_request_waits_without_the_prompt_cache():
    s = genkit.FIFOScheduler(BlockAllocator(block_size=4, num_blocks=16, allow_block_sharing=False))
    a, b = _prompted("a", list(range(100, 113)), 0), _prompted("b", list(range(100, 113)), 1)
    s.add_waiting_request(a)
    s.add_waiting_request(b)
    assert [r.request_id for r, _ in s.schedule_batch(token_budget=64)] == ["a", "b"]


def test_the_blocks_given_back_last_are_handed_out_first():
    """A new allocation takes the blocks given back most recently (their pages mapped and in cache; a
    block never used costs its first touches, about 1 ms of page faults per SmolLM2 block on a KVM
    guest), in the order their request held them; never-used blocks come lowest first."""
    alloc = BlockAllocator(block_size=4, num_blocks=8, allow_block_sharing=False)
    first = alloc.allocate(3)
    assert first == [0, 1, 2]
    second = alloc.allocate(2)
    assert second == [3, 4]
    alloc.release(first)
    assert alloc.allocate(2) == [0, 1]  # (handed out oldest-free-first before: 5, 6)
    alloc.release(second)
    assert alloc.allocate(4) == [3, 4, 2, 5] and alloc.free_blocks == 2
