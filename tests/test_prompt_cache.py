"""The prompt cache of continuous batching (``genkit.continuous.block_allocator``): a prompt's
blocks stay cached after its request finishes; a later prompt with the same start takes the full
blocks by reference and a copy of the longest matching run of the next block, computes only the
rest, and gets the tokens greedy ``generate`` gives for it alone."""

from __future__ import annotations

import pytest
import torch
from test_continuous_batching import _greedy
from test_quantized import write_quantized_gguf

import genkit
from genkit.continuous.block_allocator import BlockAllocator
from genkit.models import block_kernel
from genkit.models.paged import PagedKVStore
from genkit.models.tiny import tiny_llama


def _cached(a: BlockAllocator, prompt: list[int]) -> list[int]:
    """A request's whole life in the allocator: blocks for ``prompt``, published, given back."""
    blocks = a.allocate(a.blocks_for(len(prompt)))
    a.publish(prompt, blocks, len(prompt))
    a.release(blocks)
    return blocks


def test_a_finished_prompt_stays_cached_and_a_repeat_reuses_all_but_its_last_token():
    a = BlockAllocator(block_size=4, num_blocks=8)
    prompt = list(range(10, 20))  # two full blocks and two tokens
    old = _cached(a, prompt)
    assert a.free_blocks == 8 and a.cached_blocks == 3
    got, cached = a.cached_prefix(prompt)
    assert got == old and cached == 9  # the partial block is taken back: 19 is computed again, in place
    assert a.take_copies() == [] and a.cached_blocks == 0 and a.free_blocks == 8 - 3


def test_a_partial_block_another_request_holds_is_copied():
    a = BlockAllocator(block_size=4, num_blocks=8)
    prompt = list(range(10, 20))
    held = a.allocate(3)
    a.publish(prompt, held, 10)  # its request still runs (and writes past its prompt)
    got, cached = a.cached_prefix(prompt)
    assert got[:2] == held[:2] and got[2] not in held and cached == 9
    assert a.take_copies() == [(held[2], got[2], 1)]  # token 18 copied; 19 is computed for the logits
    a.release([held[2]])  # the copy is made: the source's pin is given back
    assert a.free_blocks == 8 - 4


def test_a_prompt_that_parts_inside_a_block_copies_the_matching_run():
    a = BlockAllocator(block_size=4, num_blocks=8)
    old = _cached(a, list(range(10, 20)))
    got, cached = a.cached_prefix([10, 11, 12, 13, 14, 15, 99, 98, 97])
    assert got[0] == old[0] and cached == 6 and a.take_copies() == [(old[1], got[1], 2)]
    a.release([old[1]])
    assert a.cached_prefix([50, 51, 52]) == ([], 0)  # nothing in common


def test_a_prompt_of_whole_blocks_takes_them_back_and_computes_its_last_token():
    a = BlockAllocator(block_size=4, num_blocks=8)
    old = _cached(a, list(range(8)))
    got, cached = a.cached_prefix(list(range(8)))
    assert got == old and cached == 7 and a.take_copies() == []


def test_a_finished_request_publishes_its_completion_too_and_a_partial_run_grows():
    a = BlockAllocator(block_size=4, num_blocks=8)
    blocks = a.allocate(3)
    a.publish([1, 2, 3, 4, 5, 6], blocks, 6)  # the prompt: a full block and a run of 2
    a.publish([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], blocks, 9)  # finished: 4 more tokens, the last one never fed
    a.release(blocks)
    got, cached = a.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 42])  # the next turn of the conversation
    assert got == blocks and cached == 9 and a.take_copies() == []


def test_allocation_evicts_the_least_recently_used_prefix_and_its_blocks_are_forgotten():
    a = BlockAllocator(block_size=4, num_blocks=4)
    first = _cached(a, [1, 2, 3, 4, 5])  # 2 blocks
    _cached(a, [7, 8, 9, 10, 11])  # 2 blocks: now all 4 are idle, cached
    assert a.free_blocks == 4 and a.cached_blocks == 4
    taken = a.allocate(2)
    assert sorted(taken) == sorted(first)  # the oldest went first
    assert a.cached_prefix([1, 2, 3, 4, 5]) == ([], 0)
    got, cached = a.cached_prefix([7, 8, 9, 10, 11])
    assert cached == 4 and len(got) == 1 and a.take_copies() == []


def test_a_cached_chain_is_evicted_from_its_end():
    a = BlockAllocator(block_size=2, num_blocks=3)
    blocks = _cached(a, [1, 2, 3, 4, 5])  # 3 blocks chained
    assert a.allocate(1) == [blocks[2]]  # the chain's last block went idle first
    assert a.cached_prefix([1, 2, 3, 4, 5]) == (blocks[:2], 4)


def test_a_block_published_under_an_evicted_one_is_unreachable():
    a = BlockAllocator(block_size=2, num_blocks=3)
    blocks = a.allocate(3)
    a.publish([1, 2, 3, 4, 5], blocks, 5)
    for b in blocks:  # given back one by one: the chain's first block is the oldest idle one
        a.release([b])
    assert a.allocate(1) == [blocks[0]]
    assert a.cached_prefix([1, 2, 3, 4, 5]) == ([], 0)
    assert a.free_blocks == 2 and blocks[0] not in a._entry


def test_giving_back_a_request_before_its_step_drops_its_copy_and_frees_the_source():
    a = BlockAllocator(block_size=4, num_blocks=8)
    _cached(a, [1, 2, 3, 4, 5, 6])
    got, cached = a.cached_prefix([1, 2, 3, 4, 5, 6])
    assert cached == 5
    a.release(got)  # the scheduler could not fit it after all
    assert a.take_copies() == [] and a.cached_blocks == 2 and a.free_blocks == 8


def test_no_copy_when_the_source_would_be_the_last_free_block():
    a = BlockAllocator(block_size=4, num_blocks=2)
    _cached(a, [1, 2, 3])  # one idle block
    held = a.allocate(1)  # the other block is in use
    assert a.cached_prefix([1, 2, 9, 5]) == ([], 0) and a.take_copies() == []  # parts at token 2: a copy
    a.release(held)


def test_sharing_off_caches_nothing():
    a = BlockAllocator(block_size=4, num_blocks=8, allow_block_sharing=False)
    _cached(a, list(range(10)))
    assert a.cached_blocks == 0 and a.cached_prefix(list(range(10))) == ([], 0)


def test_the_store_copies_a_blocks_first_slots_in_every_layer():
    store = PagedKVStore(2, 1, 3, block_size=4, num_blocks=3, dtype=torch.float32)
    for layer in range(2):
        store.keys[layer].normal_()
        store.values[layer].normal_()
    before = [v[2].clone() for v in store.values]
    store.copy(0, 2, 3)
    for layer in range(2):  # a block is (kv_heads, block_size, head_dim): its slots are the second axis
        assert torch.equal(store.keys[layer][2, :, :3], store.keys[layer][0, :, :3])
        assert torch.equal(store.values[layer][2, :, :3], store.values[layer][0, :, :3])
        assert torch.equal(store.values[layer][2, :, 3], before[layer][:, 3])  # past n: untouched
        assert not torch.equal(store.keys[layer][2, :, 3], store.keys[layer][0, :, 3])


SYSTEM = [(7 * i) % 120 + 3 for i in range(20)]  # a 20-token "system prompt": 2 full blocks of 8 and 4 tokens
PROMPTS = [SYSTEM + [5, 9, 11], SYSTEM + [6, 2], SYSTEM + [5, 9, 11], SYSTEM[:13] + [44, 45], [60, 61, 62]]
REUSED = [0, 20, 22, 13, 0]  # tokens each takes from the cache, in this order


def _served_one_by_one(model, prompts, n=8):
    manager = model.init_continuous_batching(continuous_batching_config={"block_size": 8, "num_blocks": 64})
    outs, reused = [], []
    with manager:
        for p in prompts:
            before = manager.reused_prompt_tokens
            rid = manager.add_request(p, max_new_tokens=n, eos_token_id=None)
            outs.append(manager.get_result(rid, timeout=60).generated_tokens)
            reused.append(manager.reused_prompt_tokens - before)
    return outs, reused


def test_cached_prompts_give_the_tokens_of_greedy_generate():
    torch.set_num_threads(1)
    model = tiny_llama(seed=4)
    outs, reused = _served_one_by_one(model, PROMPTS)
    assert reused == REUSED
    assert outs == [_greedy(model, p, 8) for p in PROMPTS]


def test_prompts_queued_together_compute_their_shared_part_once():
    """Prompts added at once that share most of their tokens: the first computes them, the others
    wait for it (the scheduler's ``awaits_prefix``) and take them from the prompt cache; the prompt
    sharing too little runs beside the first. The tokens are greedy ``generate``'s."""
    torch.set_num_threads(1)
    model = tiny_llama(seed=4)
    prompts = [SYSTEM + [5, 9, 11], SYSTEM + [6, 2], SYSTEM + [5, 9, 11], [60, 61, 62] + SYSTEM]
    manager = model.init_continuous_batching(continuous_batching_config={"block_size": 8, "num_blocks": 64})
    ids = [manager.add_request(p, max_new_tokens=8, eos_token_id=None) for p in prompts]  # held until start
    with manager:
        outs = [manager.get_result(rid, timeout=60).generated_tokens for rid in ids]
        assert manager.reused_prompt_tokens == 20 + 22  # the second and third took the first's prompt
    assert outs == [_greedy(model, p, 8) for p in prompts]


@pytest.mark.skipif(not block_kernel.available() or not block_kernel.simd(),
                    reason="no C compiler or vector path for the block kernel on this CPU")
def test_cached_prompts_on_the_block_kernel_give_the_tokens_of_greedy_generate(tmp_path):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    model = genkit.load_model(path)
    outs, reused = _served_one_by_one(model, PROMPTS)
    assert reused == REUSED
    assert outs == [_greedy(model, p, 8) for p in PROMPTS]
    first = PROMPTS[1]
    answer = _greedy(model, first, 8)
    turns = [first + answer + [17, 18, 19]]  # the conversation's next turn
    outs, reused = _served_one_by_one(model, [first] + turns)
    assert reused == [0, len(first) + len(answer) - 1]
    assert outs == [answer, _greedy(model, turns[0], 8)]



def test_the_next_turn_of_a_conversation_reuses_the_previous_prompt_and_completion():
    torch.set_num_threads(1)
    model = tiny_llama(seed=4)
    first = PROMPTS[1]
    answer = _greedy(model, first, 8)
    turns = [first, first + answer + [17, 18, 19]]
    outs, reused = _served_one_by_one(model, turns)
    assert reused == [0, len(first) + len(answer) - 1]  # the answer's last token was never fed to the model
    assert outs == [answer, _greedy(model, turns[1], 8)]


def _reuse_of_a_repeat(manager) -> int:
    with manager:
        for _ in range(2):
            rid = manager.add_request(PROMPTS[0], max_new_tokens=2, eos_token_id=None)
            manager.get_result(rid, timeout=60)
    return manager.reused_prompt_tokens


def test_without_block_sharing_every_prompt_is_computed_and_serve_can_ask_for_that():
    """``allow_block_sharing=False``; ``genkit serve --no-prompt-cache`` sets it
    (``make_engine(prompt_cache=False)``)."""
    from genkit.serve.engines import make_engine

    model = tiny_llama(seed=4)
    on = model.init_continuous_batching(continuous_batching_config={"block_size": 8, "num_blocks": 16})
    off = model.init_continuous_batching(continuous_batching_config={"block_size": 8, "num_blocks": 16,
                                                                     "allow_block_sharing": False})
    assert _reuse_of_a_repeat(on) == len(PROMPTS[0]) - 1
    assert _reuse_of_a_repeat(off) == 0 and off.cache.cached_blocks == 0
    served = [make_engine(model, None, prompt_cache=p) for p in (True, False)]
    try:
        assert [e.manager.cache.allow_block_sharing for e in served] == [True, False]
    finally:
        for e in served:
            e.shutdown(10)


# -- scored prompts: their tokens' scores are published with their blocks ---------------------------------------

class _Score:
    """A stand-in token score (the allocator only stores them; the request cuts ``top``)."""

    def __init__(self, token: int, top: int) -> None:
        self.token, self.top = token, tuple((token, -float(i)) for i in range(top))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Score) and (self.token, self.top) == (other.token, other.top)


def _scored(a: BlockAllocator, prompt: list[int], top: int) -> list[int]:
    """A scored request's life in the allocator: its prompt published with its tokens' scores."""
    blocks = a.allocate(a.blocks_for(len(prompt)))
    a.publish(prompt, blocks, len(prompt), scores=[None] + [_Score(t, top) for t in prompt[1:]], top=top)
    a.release(blocks)
    return blocks


def test_a_scored_prompt_takes_a_scored_prefix_less_its_last_token():
    a = BlockAllocator(block_size=4, num_blocks=8)
    prompt = list(range(10, 20))
    old = _scored(a, prompt, 2)
    other = prompt[:6] + [99, 98]  # another choice after the same context: parts at token 6
    assert a.published_scores(other, 2) == [None] + [_Score(t, 2) for t in prompt[1:6]]
    got, cached, scores = a.scored_prefix(other, 1)
    assert cached == 5 and scores == [_Score(t, 2) for t in prompt[1:6]]  # token 15 computed again: its logits
    assert got[0] == old[0] and a.take_copies() == [(old[1], got[1], 1)]


def test_scores_with_fewer_alternatives_or_none_are_not_taken():
    a = BlockAllocator(block_size=4, num_blocks=8)
    _scored(a, list(range(10, 20)), 2)
    assert a.scored_prefix(list(range(10, 20)), 3) == ([], 0, [])  # 3 alternatives wanted, 2 published
    b = BlockAllocator(block_size=4, num_blocks=8)
    _cached(b, list(range(10, 20)))  # an unscored prompt: its blocks, no scores
    assert b.scored_prefix(list(range(10, 20)), 0) == ([], 0, [])
    assert b.cached_prefix(list(range(10, 20)))[1] == 9


def test_an_evicted_block_forgets_its_scores():
    a = BlockAllocator(block_size=4, num_blocks=2)
    blocks = _scored(a, [1, 2, 3, 4, 5, 6], 1)
    assert sorted(a.allocate(2)) == sorted(blocks)  # evicted: the blocks hold other tokens now
    a.publish([1, 2, 3, 4, 5, 6], blocks, 6)  # the same tokens again, unscored
    a.release(blocks)
    assert a.published_scores([1, 2, 3, 4, 5, 6], 0) == []


def test_a_completion_extends_a_scored_run_without_scores():
    a = BlockAllocator(block_size=4, num_blocks=8)
    blocks = a.allocate(3)
    prompt = [1, 2, 3, 4, 5, 6]
    a.publish(prompt, blocks, 6, scores=[None] + [_Score(t, 0) for t in prompt[1:]], top=0)
    a.publish(prompt + [7, 8, 9], blocks, 9)  # finished: its completion is published, unscored
    a.release(blocks)
    assert a.cached_prefix(prompt + [7, 8, 9, 10])[1] == 9
    a.release(blocks)
    got, cached, scores = a.scored_prefix(prompt + [7, 8, 9, 10], 0)
    assert cached == 5 and scores == [_Score(t, 0) for t in prompt[1:]]  # the scores stop at the prompt


def test_scores_with_too_many_alternatives_are_not_kept():
    a = BlockAllocator(block_size=4, num_blocks=8)
    _scored(a, list(range(10, 20)), a.max_published_top + 1)
    assert a.published_scores(list(range(10, 20)), 0) == [] and a.cached_prefix(list(range(10, 20)))[1] == 9
