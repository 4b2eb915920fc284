"""A request running alone in continuous batching decodes as batch-1 greedy ``generate`` does
(genkit.continuous.solo): self-speculating steps on a contiguous copy of its cache, written back
into its blocks, handed back to the batch the moment another request arrives or it is cancelled.
Before, ``genkit serve`` gave a single client one token per step: 0.56-0.59x the tokens/s of
``generate`` on the same model (docs/benchmarks.md, session 28).

Tokens are compared with ``generate``'s, exactly; the written-back keys and values with the ones
``generate`` leaves in its cache (a position written to the wrong slot differs by O(1), far outside
the float32 bound); requests arrive and are cancelled from the manager's own thread (a result
handler), so each interruption happens at a known token."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_dense_kernel import _gpt2

from genkit.continuous import RequestStatus
from genkit.models import block_kernel, dense_kernel
from genkit.models.tiny import tiny_llama

pytestmark = [pytest.mark.skipif(block_kernel._compiler() is None or not dense_kernel.available(),
                                 reason="no C compiler: neither kernel exists here"),
              pytest.mark.usefixtures("gemv_route")]  # the float32 one-call decoder, where greedy steps speculate
CB = {"block_size": 8, "num_blocks": 256, "max_batch_tokens": 64}
PROMPT = [1, 17, 42, 99, 5, 23, 64, 8, 31]
OTHER = [1, 12, 9, 77, 3, 40]


@pytest.fixture(params=["llama", "gpt2"])
def model(request, tmp_path):
    torch.set_num_threads(1)
    return tiny_llama(seed=1) if request.param == "llama" else _gpt2(tmp_path)


def _generate(model, prompt: list[int], n: int, **kw):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, **kw)


def _reference(model, prompt: list[int], n: int) -> list[int]:
    return _generate(model, prompt, n)[0, len(prompt):].tolist()


class _Handler:
    """Collects a request's outputs on the manager's thread; ``at(k, action)`` runs ``action`` when
    its k-th token arrives."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()
        self.actions: dict[int, object] = {}

    def __call__(self, out) -> None:
        self.outputs.append(out)
        action = self.actions.pop(len(out.generated_tokens), None)
        if action is not None:
            action()
        if out.is_finished():
            self.done.set()

    def final(self):
        assert self.done.wait(120)
        return self.outputs[-1]


def test_a_lone_greedy_request_decodes_alone_with_generates_tokens(model):
    model.self_speculation = False
    want = _reference(model, PROMPT, 64)  # (no draft made here)
    model.self_speculation = None
    assert model.speculation_stats is None
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        deadline = time.monotonic() + 60
        while model.speculation_stats is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the draft is made while the loop is idle, before any request
        assert model.speculation_stats == {"checks": 0, "drafted": 0, "accepted": 0, "answered_ahead": 0,
                                           "one_token": 0}
        rid = manager.add_request(PROMPT, max_new_tokens=64, eos_token_id=None, streaming=True)
        seen = [len(out.generated_tokens) for out in manager.request_id_iter(rid, timeout=120)]
        steps, alone = manager.steps, manager.solo.tokens
        assert manager.solo._cache is not None  # kept for the next request while the loop runs ...
    assert manager.solo._cache is None  # ... and let go when it ends
    assert seen == list(range(1, 65))  # streamed token by token, as the batched steps stream
    assert manager.output_router.empty()
    assert alone == 63 and steps == 1  # the prompt's step chose the first token; the rest were decoded alone
    assert model.speculation_stats["checks"] > 0
    # the same request batched (no self-speculation): one step a token, the same tokens
    model.self_speculation = False
    try:
        with model.init_continuous_batching(continuous_batching_config=CB) as manager:
            out = manager.get_result(manager.add_request(PROMPT, max_new_tokens=64, eos_token_id=None), timeout=120)
            assert (manager.solo.tokens, manager.steps, manager.solo.available) == (0, 64, False)
            assert manager.solo._cache is None
    finally:
        model.self_speculation = None
    assert out.generated_tokens == want


def test_only_plain_greedy_requests_go_alone(model):
    """Log-probabilities, a sampled request, a processor, or too few tokens left: batched steps."""
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        for kwargs in ({"top_logprobs": 1}, {"do_sample": True, "seed": 3}, {"repetition_penalty": 1.3},
                       {"max_new_tokens": 8}):
            rid = manager.add_request(PROMPT, eos_token_id=None, **{"max_new_tokens": 24, **kwargs})
            assert manager.get_result(rid, timeout=120).status == RequestStatus.FINISHED
        assert manager.solo.tokens == 0
        rid = manager.add_request(PROMPT, eos_token_id=None, max_new_tokens=9)
        assert manager.get_result(rid, timeout=120).generated_tokens == _reference(model, PROMPT, 9)
        assert manager.solo.tokens == 8


def test_a_request_arriving_takes_the_lone_one_back_into_the_batch(model):
    """B arrives at A's 10th token (added on the manager's thread): A leaves its solo decode there,
    both run batched, and A goes alone again once B is done; every token is generate's."""
    want_a, want_b = _reference(model, PROMPT, 100), _reference(model, OTHER, 20)
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        a, b = _Handler(), _Handler()
        a.actions[10] = lambda: manager.register_result_handler(
            manager.add_request(OTHER, request_id="b", max_new_tokens=20, eos_token_id=None), b)
        manager.register_result_handler("a", a)
        manager.add_request(PROMPT, request_id="a", max_new_tokens=100, eos_token_id=None, streaming=True)
        assert a.final().generated_tokens == want_a
        assert b.final().generated_tokens == want_b
        # A alone for tokens 2..10, batched with B for B's 20 steps (A's tokens 11..30), then alone again
        assert manager.solo.tokens == 99 - 20
        assert manager.steps == 1 + 20


def test_a_cancelled_lone_request_stops_at_once_and_frees_its_blocks(model):
    with model.init_continuous_batching(continuous_batching_config=CB) as manager:
        free = manager.cache.free_blocks
        a = _Handler()
        a.actions[5] = lambda: manager.cancel_request("a")
        manager.register_result_handler("a", a)
        manager.add_request(PROMPT, request_id="a", max_new_tokens=200, eos_token_id=None, streaming=True)
        out = a.final()
        assert (out.status, out.finish_reason, len(out.generated_tokens)) == (RequestStatus.FAILED, "cancelled", 5)
        deadline = threading.Event()
        while manager.cache.free_blocks != free and not deadline.wait(0.01):
            pass
        assert manager.cache.free_blocks == free


def test_the_positions_computed_alone_are_in_the_requests_blocks(model):
    """The keys and values in A's blocks are those ``generate`` leaves in its cache, at every
    position and layer; a later prompt that starts with A's text reuses them from the prompt cache
    and continues alone with generate's tokens, in A's contiguous buffers refilled."""
    out = _generate(model, PROMPT, 40, return_dict_in_generate=True)
    want, cache = out.sequences[0, len(PROMPT):].tolist(), out.past_key_values
    computed = len(PROMPT) + 39  # (the last token's keys and values are never computed)
    with model.init_continuous_batching(continuous_batching_config=CB, manual_eviction=True) as manager:
        assert manager.get_result(manager.add_request(PROMPT, request_id="a", max_new_tokens=40,
                                                      eos_token_id=None), timeout=120).generated_tokens == want
        assert manager.solo.tokens == 39
        blocks = manager._kept["a"].blocks
        for layer in range(len(manager.store.keys)):
            k, v = manager.store.gather(layer, blocks, computed)
            ref_k, ref_v = cache.layer(layer)
            # the bound: the prompt's positions come from the paged prefill, generate's from its own, the same
            # float32 products summed in another order: sums of 64-128 terms of magnitude < ~4 (hidden 64,
            # intermediate 128) differ by about 128 * 4 * 2^-24 ~ 3e-5, carried through 2 layers of O(1) gain:
            # under 1e-4 on any CPU; a position in the wrong slot or layer differs by O(0.1-1)
            torch.testing.assert_close(k, ref_k[0, :, :computed], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, ref_v[0, :, :computed], rtol=1e-4, atol=1e-4)
        manager.evict_request_from_cache("a")
        follow = PROMPT + want[:24]
        before, buffer = manager.reused_prompt_tokens, manager.solo._cache.keys[0].data_ptr()
        got = manager.get_result(manager.add_request(follow, max_new_tokens=12, eos_token_id=None), timeout=120)
        assert manager.reused_prompt_tokens - before >= 32  # whole blocks of A's prompt and completion
        assert manager.solo.tokens == 39 + 11
        assert manager.solo._cache.keys[0].data_ptr() == buffer  # refilled A's buffers, no fresh memory
    assert got.generated_tokens == _reference(model, follow, 12)


def test_a_served_lone_greedy_completion_decodes_alone(tmp_path):
    """Through ``genkit serve`` (the continuous engine, in this process): a greedy completion running
    alone is generate's text, and ``genkit_generated_tokens_alone_total`` counts its tokens decoded
    alone (all but the first, which the prompt's step chose)."""
    import json
    import urllib.request

    from test_engine_gate import _raw_tokenizer, _serving  # (a word-level tokenizer: a word per token)

    from genkit.serve import build_app
    from genkit.tokenizer import Tokenizer

    pytest.importorskip("starlette")
    torch.set_num_threads(1)
    model = tiny_llama(seed=1)
    tokenizer = Tokenizer(_raw_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    want = _reference(model, PROMPT, 24)

    def metric(base: str) -> float:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith("genkit_generated_tokens_alone_total ")))

    with _serving(build_app(model, tokenizer=tokenizer, model_name="tiny")) as base:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        assert metric(base) == 23
    assert text == tokenizer.decode(want, skip_special_tokens=True)
