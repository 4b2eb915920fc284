"""Greedy and top-k steps that give the argmax, or the logits a top-k filter keeps, without every
logit (issue 32, float32 batch 1).

Where greedy search has nothing else reading a step's scores (no logits processor, no
``output_scores``/``output_logits``, no stopping criterion, no streamer ``put_step``), it asks the
model for the token alone (``Stepper.forward_greedy`` -> ``greedy_step``). genkit's Llama then runs
the one-call step and takes each row's argmax in the same kernel call; a float32 head on the gemv
route is read through an 8-bit copy, with a bound on how far each row's exact logit can lie from
the copy's, and only the rows that can hold the maximum are computed exactly, by the same float
operations as the whole head. The tokens must be those of the logits path, bit for bit: ties go to
the first index, a NaN counts as the largest, as numpy's argmax. Sampling whose processors begin
with a temperature and a top-k filter asks for the logits that can be among the k largest
(``Stepper.forward_top`` -> ``top_logits_step``): the rest are -inf, and the filtered scores, the
draws and the recorded scores must be the logits path's, bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_block_kernel import quantized  # noqa: F401  (the tiny Q4_1 GGUF model fixture)

from builtin_strategies.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    top_k_first,
)
from genkit.models import block_kernel, dense_kernel
from genkit.models.llama import LlamaForCausalLM
from genkit.models.tiny import tiny_llama
from genkit.strategy import StoppingCriteriaList

pytestmark = pytest.mark.skipif(block_kernel._compiler() is None or not dense_kernel.available(),
                                reason="no C compiler: neither kernel exists here")
IDS = torch.tensor([[1, 17, 33, 5, 60, 9]])
KW = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(autouse=True)
def one_token_steps(gemv_route, monkeypatch):
    """The gemv route, and the one-token greedy step itself (tests/test_self_speculation.py: steps
    that check drafts)."""
    monkeypatch.setattr(LlamaForCausalLM, "self_speculation", False)


def _counting(model, name="greedy_step"):
    """Count the steps of the model's ``name`` that gave tokens or logits (its own method runs)."""
    calls = {"tokens": 0, "none": 0}
    method = getattr(type(model), name).__get__(model)

    def step(*args, **kwargs):
        out = method(*args, **kwargs)
        calls["none" if out is None else "tokens"] += 1
        return out

    setattr(model, name, step)
    return calls


def _without_greedy_steps(model, name="greedy_step", ids=IDS, **kw):
    setattr(model, name, lambda *args, **kwargs: None)  # every step through forward's logits
    try:
        torch.manual_seed(7)
        with torch.no_grad():
            return model.generate(ids, **{**KW, **kw})
    finally:
        delattr(model, name)


def _greedy(model, name="greedy_step", ids=IDS, **kw):
    calls = _counting(model, name)
    try:
        torch.manual_seed(7)
        with torch.no_grad():
            out = model.generate(ids, **{**KW, **kw})
    finally:
        delattr(model, name)
    return out, calls


# -- the kernel pieces -----------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "k"), [(128, 64), (100, 203), (300, 256), (2053, 67), (16, 8)])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_chosen_columns_are_bit_for_bit_the_whole_products(n, k, threads):
    """gk_gemv_t_cols gives the columns of the blocks it is asked for with the very bits gk_gemv_t
    gives them (the same split of K among threads, the same operations), tails of 16 and of the
    weight streams included, and leaves the other columns alone."""
    lib = dense_kernel.library()
    g = torch.Generator().manual_seed(n + k + threads)
    w = torch.randn(k, n, generator=g).t()  # column-major (n, k)
    x = torch.randn(1, k, generator=g)
    whole = torch.empty(1, n)
    assert lib.gk_gemv_t(x.data_ptr(), k, w.data_ptr(), n, whole.data_ptr(), 1, n, k, threads) == 0
    nblocks = (n + 15) // 16
    for blocks in (list(range(nblocks)), sorted({0, nblocks - 1, nblocks // 2})):
        chosen = torch.tensor(blocks, dtype=torch.int32)
        got = torch.full((n,), 7.0)
        lib.gk_gemv_t_cols(x.data_ptr(), w.data_ptr(), n, got.data_ptr(), n, k, threads, chosen.data_ptr(), len(blocks))
        cols = torch.tensor([j for b in blocks for j in range(16 * b, min(16 * b + 16, n))])
        assert torch.equal(got[cols], whole[0, cols])
        rest = torch.ones(n, dtype=torch.bool)
        rest[cols] = False
        assert (got[rest] == 7.0).all()


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_the_heads_8_bit_copy_keeps_every_logit_within_its_bound(scale):
    """head_proxy's bound holds for every row: |exact logit - the copy's| <= bound * ||h||, for
    hidden states of either sign pattern, one aligned with a row's rounding error (the worst case
    for that row) and one of mixed magnitudes, for rows of very different scales."""
    g = torch.Generator().manual_seed(3)
    n, k = 200, 96
    w = (torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None] * scale).t().contiguous().t()
    made = block_kernel.head_proxy(w)
    assert made is not None
    blocks, bound = made
    assert blocks.shape == (13, 3, block_kernel.BLOCK_BYTES[8]) and bound.shape == (n,) and (bound > 0).all()
    copy = block_kernel.matmul(torch.eye(k), blocks, 8, 13 * 16)[:, :n].t().double()  # the copy's weights
    worst = torch.sign(w.double() - copy)[5].float()  # aligned with row 5's rounding error
    for x in (torch.randn(4, k, generator=g), worst[None] * 3.0, torch.randn(1, k, generator=g) * torch.logspace(-4, 2, k)):
        exact = torch.empty(x.shape[0], n)
        assert dense_kernel.library().gk_gemv_t(x.data_ptr(), k, w.data_ptr(), n, exact.data_ptr(), x.shape[0], n, k, 1) == 0
        proxy = block_kernel.matmul(x, blocks, 8, 13 * 16)[:, :n]
        gap = (exact.double() - proxy.double()).abs()
        assert (gap <= bound.double() * x.double().norm(dim=1, keepdim=True)).all()
    assert float(gap[0, 5] / (bound[5] * x.double().norm())) < 1  # (not vacuous: the rows differ)


def test_a_head_the_copy_cannot_hold_has_none():
    w = torch.randn(64, 128).t().contiguous().t()
    assert block_kernel.head_proxy(w) is not None
    bad = w.clone()
    bad[3, 5] = float("nan")
    assert block_kernel.head_proxy(bad) is None  # not finite
    assert block_kernel.head_proxy(w.contiguous()) is None  # row-major: not the gemv route's head
    assert block_kernel.head_proxy(torch.randn(40, 64).t()[:, :50]) is None  # K not a multiple of 32
    assert block_kernel.head_proxy(w * 1e5) is None  # scales past float16


# -- generate ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_tokens_through_the_copy_equal_the_logits_paths(threads, tied):
    """On the gemv route every greedy step after the prompt gives its token without the logits,
    and the tokens are the logits path's."""
    torch.set_num_threads(threads)
    model = tiny_llama(seed=11, tie_word_embeddings=tied, vocab_size=512)
    if tied:
        model.tie_weights()
    want = _without_greedy_steps(model, max_new_tokens=24)
    got, calls = _greedy(model, max_new_tokens=24)
    assert torch.equal(got, want)
    assert calls == {"tokens": 23, "none": 0}
    assert model._prepared[1].decoder._proxy[1] is not None  # the 8-bit copy was made and used


def _last_step(model, ids):
    """Logits of the step after ``ids`` through forward, and the greedy step's tokens, each on its own cache."""
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, **KW)  # prepares the routes
        a, b = (model(ids[:, :-1], use_cache=True).past_key_values for _ in range(2))
        logits = model(ids[:, -1:], past_key_values=a).logits[:, -1]
        tokens = model.greedy_step(ids[:, -1:], None, None, b)
    return logits, tokens


def test_ties_go_to_the_first_index_and_a_nan_wins():
    """Rows of the head equal to the winning row (here the first, a middle and the last ones)
    tie with it bit for bit: the first of them is the token, as numpy's argmax gives. A NaN in the
    head: the copy cannot be made, every logit is computed, and the first NaN is the token."""
    model = tiny_llama(seed=4, vocab_size=512)
    logits, _ = _last_step(model, IDS)
    top = int(logits.argmax())
    with torch.no_grad():
        for row in (0, 250, 511):
            model.lm_head.weight[row] = model.lm_head.weight[top]
    model._prepared = None
    logits, tokens = _last_step(model, IDS)
    assert logits[0, 0] == logits[0, top] == logits[0, 511] and tokens.tolist() == [0] == [int(logits.argmax())]
    with torch.no_grad():
        model.lm_head.weight[300, 3] = float("nan")
    model._prepared = None
    logits, tokens = _last_step(model, IDS)
    assert model._prepared[1].decoder._proxy[1] is None and tokens.tolist() == [300] == [int(logits.argmax())]


def _crowd(model, like, rows, seed):
    """Head rows ``rows`` set a hair's breadth (0.1 % of its scale) from row ``like``: logits the 8-bit
    copy cannot order; the prepared weights are dropped so that the next step makes a new copy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.lm_head.weight
        for row in rows:
            w[row] = w[like] + 1e-3 * w[like].abs().max() * torch.randn(w.shape[1], generator=g)
    model._prepared = None


def test_rows_the_copy_cannot_tell_apart_are_computed_exactly():
    """Twenty rows of the head a hair's breadth from the winning row (0.1 % of its scale): the 8-bit
    copy ranks them otherwise than the exact logits do (checked), and the greedy step still gives
    the exact argmax, from the rows it computes exactly."""
    model = tiny_llama(seed=4, vocab_size=512)
    logits, _ = _last_step(model, IDS)
    _crowd(model, int(logits.argmax()), range(100, 500, 20), 0)
    seen = []
    handle = model.model.norm.register_forward_hook(lambda _m, _a, out: seen.append(out[:, -1].detach().clone()))
    try:
        logits, _ = _last_step(model, IDS)  # (the hook keeps the modules: the final norm's output is seen)
    finally:
        handle.remove()
    model._prepared = None
    _, tokens = _last_step(model, IDS)
    blocks, _bound = model._prepared[1].decoder._proxy[1]
    copy = block_kernel.matmul(torch.eye(64), blocks, 8, 512).t()
    assert int((seen[-1] @ copy.t()).argmax()) != int(logits.argmax())  # the copy alone would be wrong
    assert tokens.tolist() == [int(logits.argmax())]


def test_too_many_near_rows_compute_the_whole_head():
    """A head of 2048 equal rows puts every row within the bound of the largest: more blocks than
    the exact pass takes, so the whole head is computed; the token is still the first index."""
    model = tiny_llama(seed=2, vocab_size=2048)
    with torch.no_grad():
        model.lm_head.weight[:] = model.lm_head.weight[7]
    logits, tokens = _last_step(model, IDS)
    assert (logits == logits[0, 0]).all() and tokens.tolist() == [0]


def test_a_head_written_in_place_gets_a_new_copy():
    """The copy is keyed by the head tensor's version: an in-place edit between two generations
    (here making one row win every step) is seen by the next greedy step."""
    model = tiny_llama(seed=9, vocab_size=512)
    _greedy(model, max_new_tokens=4)
    first = model._prepared[1].decoder._proxy
    with torch.no_grad():
        model.lm_head.weight[77] = model.model.norm.weight * 50.0  # aligned with the final norm's output
    want = _without_greedy_steps(model, max_new_tokens=8)
    got, calls = _greedy(model, max_new_tokens=8)
    assert torch.equal(got, want) and calls["tokens"] == 7
    assert model._prepared[1].decoder._proxy is not first


def test_threads_generating_on_one_model_get_their_own_tokens():
    """Four threads generate greedily on one float32 model at once, from different prompts (each
    making the copy at its first step, racing the others): each gets the tokens it gets alone."""
    model = tiny_llama(seed=13, vocab_size=512)
    prompts = [IDS + i for i in range(4)]
    with torch.no_grad():
        alone = [model.generate(p, max_new_tokens=32, **KW) for p in prompts]
    model._prepared = None  # the copy is made again, by whichever thread gets there first
    got = generate_at_once(model, prompts, max_new_tokens=32, **KW)
    assert all(torch.equal(a, b) for a, b in zip(got, alone))


def generate_at_once(model, prompts, **kwargs):
    """``model.generate(prompt, **kwargs)`` for every prompt, each in a thread of its own, all at once
    (tests/test_self_speculation.py too); the outputs in the prompts' order."""
    import threading

    got: list = [None] * len(prompts)

    def run(i):
        with torch.no_grad():
            got[i] = model.generate(prompts[i], **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return got


def test_a_quantized_heads_greedy_step_takes_the_argmax_of_all_its_logits(quantized):  # noqa: F811
    """A block-weight head has no copy: every logit is computed in the call, and the argmax is taken
    there; the tokens are the logits path's, for one row and for three rows at one position."""
    for ids in (IDS, IDS.repeat(3, 1) + torch.arange(3)[:, None]):
        logits, tokens = _last_step(quantized, ids)
        assert tokens is not None and tokens.tolist() == logits.argmax(-1).tolist()
    want = _without_greedy_steps(quantized, max_new_tokens=12)
    got, calls = _greedy(quantized, max_new_tokens=12)
    assert torch.equal(got, want) and calls == {"tokens": 11, "none": 0}


@pytest.mark.parametrize("how", ["forward hook", "pre-hook", "global hook", "subclass", "instance forward"])
def test_whatever_wraps_the_models_forward_runs_every_step(how):
    """A hook on the model, a global one, or a forward of a subclass or of the instance may change
    the logits (here: every step forced to token 5): greedy steps then run the model's forward."""
    from torch.nn.modules.module import register_module_forward_hook

    def force(_m, _args, out):
        out.logits[..., :] = -1.0
        out.logits[..., 5] = 1.0
        return out

    class Forced(type(tiny_llama())):
        def forward(self, *args, **kwargs):
            return force(self, args, super().forward(*args, **kwargs))

    model = tiny_llama(seed=11, vocab_size=512)
    handle = None
    if how == "forward hook":
        handle = model.register_forward_hook(force)
    elif how == "pre-hook":
        seen = []
        handle = model.register_forward_pre_hook(lambda _m, args: seen.append(1))
    elif how == "global hook":
        handle = register_module_forward_hook(lambda m, a, out: force(m, a, out) if m is model else out)
    elif how == "subclass":
        model.__class__ = Forced
    else:
        plain = model.forward
        model.forward = lambda *args, **kwargs: force(model, args, plain(*args, **kwargs))
    try:
        out, calls = _greedy(model, max_new_tokens=8)
    finally:
        if handle is not None:
            handle.remove()
    assert calls["tokens"] == 0
    if how == "pre-hook":
        assert len(seen) == 8  # the prompt and seven steps
    else:
        assert out[0, IDS.shape[1]:].tolist() == [5] * 8


# -- when greedy search asks for tokens alone ------------------------------------------------------
def test_a_logits_processor_keeps_the_logits_path():
    """A repetition penalty changes the tokens here; with it, no step asks for the argmax alone."""
    model = tiny_llama(seed=11, vocab_size=512)
    plain = _without_greedy_steps(model, max_new_tokens=24)
    got, calls = _greedy(model, max_new_tokens=24, repetition_penalty=3.0)
    assert calls == {"tokens": 0, "none": 0}
    assert torch.equal(got, _without_greedy_steps(model, max_new_tokens=24, repetition_penalty=3.0))
    assert not torch.equal(got, plain)


@pytest.mark.parametrize("ask", ["output_scores", "output_logits", "criterion", "put_step"])
def test_whatever_reads_the_scores_gets_them_every_step(ask):
    model = tiny_llama(seed=11, vocab_size=512)
    seen = []

    class Criterion:
        def __call__(self, input_ids, scores):
            seen.append(scores)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

        def put_step(self, scores, finished):
            seen.append(scores)

    kw = {"output_scores": {"output_scores": True, "return_dict_in_generate": True},
          "output_logits": {"output_logits": True, "return_dict_in_generate": True},
          "criterion": {"stopping_criteria": StoppingCriteriaList([Criterion()])},
          "put_step": {"streamer": Streamer()}}[ask]
    out, calls = _greedy(model, max_new_tokens=6, **kw)
    assert calls == {"tokens": 0, "none": 0}
    if ask in ("criterion", "put_step"):
        assert len(seen) == 6 and all(s is not None and s.shape == (1, 512) for s in seen)
    else:
        assert len(out.scores if ask == "output_scores" else out.logits) == 6


# -- top-k sampling ----------------------------------------------------------------------------------
SAMPLE = dict(do_sample=True, top_k=20, temperature=0.7, top_p=0.9, max_new_tokens=24, output_scores=True,
              return_dict_in_generate=True)


def test_the_top_k_filter_must_come_first():
    temp, top, nucleus = TemperatureLogitsWarper(0.5), TopKLogitsWarper(7), TopPLogitsWarper(0.9)
    assert top_k_first([top]) == 7 and top_k_first([temp, top, nucleus]) == 7
    assert top_k_first([temp, TopKLogitsWarper(3, min_tokens_to_keep=5)]) == 5
    assert top_k_first([temp, temp, top]) is None  # (generate builds one temperature)
    assert top_k_first([TemperatureLogitsWarper(1e-4), top]) is None  # quotients could leave float's range
    assert top_k_first([RepetitionPenaltyLogitsProcessor(1.2), top]) is None
    assert top_k_first([temp, nucleus, top]) is None and top_k_first([]) is None and top_k_first([temp]) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_top_k_sampling_draws_and_scores_equal_the_logits_paths(threads):
    """Temperature, top-k and top-p sampling: every step after the prompt gives the logits that can
    be among the 20 largest (the rest -inf), and the draws and the recorded (processed) scores are
    the logits path's, bit for bit."""
    torch.set_num_threads(threads)
    model = tiny_llama(seed=11, vocab_size=512)
    want = _without_greedy_steps(model, "top_logits_step", **SAMPLE)
    got, calls = _greedy(model, "top_logits_step", **SAMPLE)
    assert calls == {"tokens": 23, "none": 0}
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == 24 and all(torch.equal(a, b) for a, b in zip(got.scores, want.scores))
    assert all(int(torch.isfinite(s).sum()) <= 20 for s in got.scores)  # (the filter ran on them)


@pytest.mark.parametrize("k", [1, 5, 40, 600])
def test_a_top_k_step_is_exact_wherever_the_filter_keeps_a_logit(k):
    """Rows a hair's breadth from the one at the k-th largest logit (the copy cannot order them):
    the step's logits equal forward's at every entry a temperature and top-k filter keeps, and the
    filtered scores are equal; k past the vocabulary computes every logit."""
    model = tiny_llama(seed=4, vocab_size=512)
    logits, _ = _last_step(model, IDS)
    _crowd(model, int(logits[0].topk(min(k, 512)).indices[-1]), range(3, 500, 25), 1)
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=1, **KW)
        a, b = (model(IDS[:, :-1], use_cache=True).past_key_values for _ in range(2))
        full = model(IDS[:, -1:], past_key_values=a).logits[:, -1]
        top = model.top_logits_step(IDS[:, -1:], None, None, b, k)[:, -1]
    assert b.lengths == a.lengths
    warp = [TemperatureLogitsWarper(0.3), TopKLogitsWarper(k)]
    filtered = [full, top]
    for p in warp:
        filtered = [p(IDS, f) for f in filtered]
    assert torch.equal(filtered[0], filtered[1])
    kept = torch.isfinite(filtered[0])
    assert torch.equal(top[kept], full[kept]) and int(kept.sum()) >= min(k, 512)
    if k >= 512:
        assert torch.equal(top, full)
    else:
        assert bool(torch.isinf(top).any())  # (not every logit was computed)


def test_what_the_filter_does_not_lead_keeps_the_logits_path():
    """A repetition penalty before the filter, raw logits recorded, or more than one row: no top-k
    steps, and the same draws as the logits path."""
    model = tiny_llama(seed=11, vocab_size=512)
    for kw in ({"repetition_penalty": 1.3}, {"output_logits": True}, {"ids": IDS.repeat(2, 1)}):
        want = _without_greedy_steps(model, "top_logits_step", **{**SAMPLE, **kw})
        got, calls = _greedy(model, "top_logits_step", **{**SAMPLE, **kw})
        assert calls["tokens"] == 0 and torch.equal(got.sequences, want.sequences), kw


# -- continuous batching ----------------------------------------------------------------------------
def _paged_decode_step(model, prompts, greedy):
    """The prompts' logits steps on a new paged store, then one decode step of every request (the
    next token after each prompt: its argmax) with ``greedy``: what ``forward_paged`` returns."""
    from genkit.models.paged import StepBatch

    store = model.new_paged_store(block_size=4, num_blocks=64)
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    nexts = []
    with torch.inference_mode():
        for p, b in zip(prompts, blocks):
            logits = model.forward_paged(StepBatch(torch.tensor(p), torch.arange(len(p)), [(0, len(p))], [0], [b],
                                                   [True]), store)
            nexts.append(int(logits[0].argmax()))
        k = len(prompts)
        step = StepBatch(torch.tensor(nexts), torch.tensor([len(p) for p in prompts]), [(i, 1) for i in range(k)],
                         [len(p) for p in prompts], blocks, [True] * k)
        return model.forward_paged(step, store, greedy=greedy)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_continuous_batching_greedy_step_gives_its_logits_argmax_through_the_copy(threads):
    """A one-call paged step asked for greedy tokens (every request plain greedy) reads the float32
    head through its 8-bit copy, for all rows at once, and gives each row's first maximum of the
    logits the same step gives: with head rows the copy ranks wrongly (checked) too."""
    torch.set_num_threads(threads)
    model = tiny_llama(seed=4, vocab_size=512)
    prompts = [[1, 17, 33, 5, 60, 9], [4, 8, 15, 16], [23, 42, 7, 7, 7, 7, 7], [99]]
    logits = _paged_decode_step(model, prompts, greedy=False)
    _crowd(model, int(logits[0].argmax()), range(100, 500, 20), 0)
    logits = _paged_decode_step(model, prompts, greedy=False)
    assert logits.dtype == torch.float32 and model._prepared[1].decoder._proxy is None  # no copy for logits
    tokens = _paged_decode_step(model, prompts, greedy=True)
    blocks, _bound = model._prepared[1].decoder._proxy[1]  # the copy was made and read
    assert tokens.dtype == torch.long and tokens.tolist() == logits.argmax(-1).tolist()
    copy = block_kernel.matmul(torch.eye(64), blocks, 8, 512).t()
    hidden = torch.linalg.lstsq(model.lm_head.weight.detach(), logits.t()).solution.t()  # the final norm's output
    assert int((hidden[0] @ copy.t()).argmax()) != tokens[0]  # the copy alone would pick another token


def test_continuous_batching_gives_plain_greedy_requests_their_tokens_through_the_copy():
    """``generate_batch`` of plain greedy requests runs its steps' heads through the 8-bit copy, and
    every request's tokens are its own generate's through the logits."""
    model = tiny_llama(seed=4, vocab_size=512)
    _crowd(model, 300, range(100, 500, 20), 1)
    prompts = [[1, 17, 33, 5, 60, 9], [4, 8, 15, 16], [23, 42, 7, 7, 7, 7, 7]]
    want = [_without_greedy_steps(model, ids=torch.tensor([p]), max_new_tokens=10)[0, len(p):].tolist()
            for p in prompts]
    model._prepared = None
    got = model.generate_batch(prompts, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert model._prepared[1].decoder._proxy[1] is not None
    assert [o.generated_tokens for o in got.values()] == want


def test_a_paged_model_without_greedy_steps_gets_logits_and_requests_with_logprobs_keep_theirs():
    """A model whose ``forward_paged`` takes no ``greedy`` (the protocol before it) is asked for
    logits; a request that records log-probabilities among plain greedy ones makes its steps give
    logits, and its log-probabilities are recorded."""
    class LogitsOnly(LlamaForCausalLM):
        def forward_paged(self, batch, store):
            return super().forward_paged(batch, store)

    base = tiny_llama(seed=5, vocab_size=512)
    model = LogitsOnly(base.config)
    model.load_state_dict(base.state_dict())
    prompts = [[1, 17, 33, 5, 60, 9], [4, 8, 15, 16]]
    want = [_without_greedy_steps(base, ids=torch.tensor([p]), max_new_tokens=6)[0, len(p):].tolist()
            for p in prompts]
    got = model.generate_batch(prompts, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert [o.generated_tokens for o in got.values()] == want
    from genkit.continuous.manager import ContinuousBatchingManager

    with ContinuousBatchingManager(base) as manager:
        plain = manager.add_request(prompts[0], max_new_tokens=6, do_sample=False, eos_token_id=None)
        scored = manager.add_request(prompts[1], max_new_tokens=6, do_sample=False, eos_token_id=None, top_logprobs=0)
        outs = {o.request_id: o for o in (manager.get_result(rid, timeout=30) for rid in (plain, scored))}
    assert [outs[plain].generated_tokens, outs[scored].generated_tokens] == want
    assert len(outs[scored].logprobs) == 6 and all(lp <= 0 for lp in outs[scored].logprobs)
