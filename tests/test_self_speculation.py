"""Exact self-speculative greedy steps (genkit.models.self_speculation; issue 32, float32 batch 1).

Greedy search on a float32 model on the dense one-call decoder drafts tokens with an 8-bit copy of
the model and checks them in one step whose rows each compute what a one-token step computes. The
tokens must be plain greedy search's, whatever the draft proposes; the checks here compare bits
(products, logits, keys and values), not closeness."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from genkit.models import block_kernel, dense_kernel
from genkit.models.cache import KVCache
from genkit.models.self_speculation import EXPLORE, GAMMA_MAX, GAMMA_START, RESCORE, Pace, _room, build_draft
from genkit.models.tiny import tiny_llama

pytestmark = [pytest.mark.skipif(block_kernel._compiler() is None or not dense_kernel.available(),
                                 reason="no C compiler: neither kernel exists here"),
              pytest.mark.usefixtures("gemv_route")]
IDS = torch.tensor([[1, 17, 33, 5, 60, 9]])
KW = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def _greedy(model, spec, **kw):
    model.self_speculation = spec
    return model.generate(IDS, **{**KW, "max_new_tokens": 48, **kw})


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (50, 200), (1000, 40), (7, 37)])
def test_a_rows_product_is_the_same_bits_as_the_row_alone(n, k, threads):
    """The dense kernel's column-major product over up to 16 rows gives each row the bits of that row
    alone (the check of a speculative step relies on it); N and K off the vector width and the
    kernel's stream count included."""
    lib = dense_kernel.library()
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(k, n, generator=gen).t()  # (n, k) column-major, as genkit lays weights out
    for m in (2, 3, 5, 16):
        x = torch.randn(m, k, generator=gen)
        rows = torch.empty(m, n)
        assert lib.gk_gemv_t(x.data_ptr(), k, w.data_ptr(), n, rows.data_ptr(), m, n, k, threads) == 0
        for i in range(m):
            alone = torch.empty(1, n)
            xi = x[i:i + 1].clone()
            assert lib.gk_gemv_t(xi.data_ptr(), k, w.data_ptr(), n, alone.data_ptr(), 1, n, k, threads) == 0
            assert torch.equal(rows[i], alone[0]), (m, i)
        torch.testing.assert_close(rows, x @ w.t(), rtol=1e-4, atol=1e-4)


def _prepared_cache(model, new=3):
    model.self_speculation = False
    out = model.generate(IDS, **KW, max_new_tokens=new, return_dict_in_generate=True)
    cache = out.past_key_values
    prepared = model._weights_on(cache)[1]
    assert prepared is not None and prepared.decoder is not None and prepared.decoder.dense
    return out.sequences, cache, prepared


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context", [3, 70])
def test_the_check_gives_each_token_the_logits_keys_and_values_of_a_one_token_step(threads, context):
    """(The check's attention reads each position's key and value once for all its tokens, 12 query
    vectors at a time, where a one-token step reads them for its own: the same bits.)"""
    torch.set_num_threads(threads)
    model = tiny_llama(seed=3)
    seq, cache, prepared = _prepared_cache(model, new=context)
    decoder, ends = prepared.decoder, model.kernel_ends(prepared)
    tokens = torch.tensor([int(seq[0, -1]), 7, 99, 7, 12, 3, 64, 5])
    t, pos = tokens.shape[0], cache.lengths[0]
    with torch.inference_mode():  # (the cache's buffers were made by generate, in inference mode)
        assert _room(cache, pos + t)  # (as a speculative round makes it)
        alone = copy.deepcopy(cache)
        steps = []
        for i in range(t):
            cos, sin = model.rope(None, torch.float32, pos + i, 1)
            steps.append(decoder.logits(tokens[i:i + 1].view(1, 1), cos, sin, alone, ends)[0, 0])
        cos, sin = model.rope(None, torch.float32, pos, t)
        logits = torch.empty(t, ends.outputs)
        greedy = decoder.verify(tokens, cos.reshape(t, -1), sin.reshape(t, -1), cache, ends, logits)
    assert cache.lengths == [pos + t] * len(cache.lengths) == alone.lengths
    for i in range(t):
        assert torch.equal(logits[i], steps[i]), i
    assert greedy.tolist() == [int(torch.argmax(s)) for s in steps]
    for layer in range(len(cache.lengths)):
        assert torch.equal(cache.keys[layer][:, :, :pos + t], alone.keys[layer][:, :, :pos + t])
        assert torch.equal(cache.values[layer][:, :, :pos + t], alone.values[layer][:, :, :pos + t])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head", ["as made", "twin rows", "one row repeated"])
def test_a_check_through_the_heads_copy_gives_the_whole_heads_tokens(threads, head):
    """A check that wants only tokens reads the float32 head through its 8-bit copy (once for all
    rows), then the exact logits of the blocks that can hold each row's largest: the tokens are the
    whole head's first maxima, ties (twin rows: every logit twice) included."""
    torch.set_num_threads(threads)
    model = tiny_llama(seed=4)
    with torch.no_grad():
        w = model.lm_head.weight
        if head == "twin rows":
            w[1::2] = w[0::2]
        elif head == "one row repeated":
            w[:] = w[5]
    seq, cache, prepared = _prepared_cache(model)
    decoder, ends = prepared.decoder, model.kernel_ends(prepared)
    gen = torch.Generator().manual_seed(threads)
    pos = cache.lengths[0]
    for t in (1, 2, 7, 16):
        tokens = torch.randint(0, model.config.vocab_size, (t,), generator=gen)
        cos, sin = model.rope(None, torch.float32, pos, t)
        cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
        with torch.inference_mode():
            logits = torch.empty(t, ends.outputs)
            ways = {"logits": decoder.verify(tokens, cos, sin, copy.deepcopy(cache), ends, logits),
                    "whole head": decoder.verify(tokens, cos, sin, copy.deepcopy(cache), ends, head_copy=False),
                    "copy": decoder.verify(tokens, cos, sin, copy.deepcopy(cache), ends)}
        first_max = [int(torch.argmax(row)) for row in logits]  # (torch's argmax: the first maximum)
        assert {w: v.tolist() for w, v in ways.items()} == {w: first_max for w in ways}, t
        if head == "one row repeated":
            assert first_max == [0] * t
    assert decoder._proxy is not None and decoder._proxy[1] is not None  # the copy was made and read


@pytest.mark.parametrize("threads", [1, 2])
def test_a_draft_step_takes_the_largest_float32_logit_among_its_4_bit_heads_best(threads):
    """The draft's head is 4-bit; a draft step computes the blocks of its RESCORE largest logits again
    from the model's float32 head and takes the first maximum there: on a tiny model (8 blocks of 16
    tokens) that is the argmax of the draft's layers followed by the float32 head."""
    from genkit.models.block_decode import _ends

    torch.set_num_threads(threads)
    model = tiny_llama(seed=5)
    seq, cache, prepared = _prepared_cache(model, new=24)
    draft, head = model._draft_for(prepared), prepared.for_rows(1)[1]
    assert draft.head.bits == 4 and draft.ends.rescore == RESCORE
    exact = _ends(model.model.embed_tokens, model.model.norm.weight.detach(), float(model.model.norm.eps), False,
                  head, draft.decoder.hidden, model.kernel_ends(prepared).gemv)
    with torch.inference_mode():
        for pos in range(IDS.shape[1], seq.shape[1]):
            token, steps = seq[0, pos:pos + 1].view(1, 1), []
            for ends in (draft.ends, exact):
                at = copy.deepcopy(cache)
                at.lengths[:] = [pos] * len(at.lengths)
                cos, sin = model.rope(None, torch.float32, pos, 1)
                step = draft.decoder.argmax if ends is draft.ends else draft.decoder.logits
                steps.append(step(token, cos, sin, at, ends))
            assert int(steps[0][0]) == int(torch.argmax(steps[1][0, 0])), pos


def test_a_draft_attends_over_a_window_and_the_tokens_stay_plain_greedy_search(monkeypatch):
    """A draft step attends over the first DRAFT_SINK positions and the last DRAFT_WINDOW only (its
    cost stays flat with the context): other drafts than with every position, the same tokens."""
    from genkit.models import self_speculation

    model = tiny_llama(seed=13)
    plain = _greedy(model, False, max_new_tokens=96)
    drafts = {}
    for window in (0, 8):  # (0: every position)
        monkeypatch.setattr(self_speculation, "DRAFT_WINDOW", window)
        monkeypatch.setattr(self_speculation, "DRAFT_SINK", 2)
        model.__dict__.pop("_self_draft", None)
        assert torch.equal(_greedy(model, True, max_new_tokens=96), plain)
        assert all(layer.window == window for layer in model.__dict__["_self_draft"][1].decoder.table)
        drafts[window] = model.speculation_stats
    assert drafts[8]["checks"] > 0
    # the kernel attends over the window: a draft step's logits past sink + window differ from those over
    # every position, and are the same bits where the context is not longer than sink + window
    seq, cache, prepared = _prepared_cache(model, new=40)
    draft = model._draft_for(prepared)
    for pos, same in ((seq.shape[1] - 1, False), (9, True)):
        cos, sin = model.rope(None, torch.float32, pos, 1)
        steps = []
        for window in (8, 0):
            for layer in draft.decoder.table:
                layer.window = window
            at = copy.deepcopy(cache)
            at.lengths[:] = [pos] * len(at.lengths)
            with torch.inference_mode():
                steps.append(draft.decoder.logits(seq[:, pos:pos + 1], cos, sin, at, draft.ends))
        assert torch.equal(steps[0], steps[1]) == same, pos


def test_the_pace_leaves_each_lengths_first_check_untimed_and_times_both_ways_of_reading_the_head():
    pace = Pace()
    pace.record(4, 0.020, 5, 0.175, 4)  # the first check at 5 rows: a warm-up (the head's copy made in it)
    assert pace.check_s == {} and pace.draft_s == pytest.approx(0.005)
    assert pace.best(GAMMA_MAX) == GAMMA_START and pace.head_copy(5)
    pace.record(4, 0.020, 5, 0.018, 4)
    assert pace.check_s == {(5, True): 0.018}
    assert not pace.head_copy(5)  # the whole head next: warmed up, then timed
    pace.record(4, 0.020, 5, 0.030, 4, copy=False)
    assert not pace.head_copy(5) and (5, False) not in pace.check_s
    pace.record(4, 0.020, 5, 0.020, 4, copy=False)
    assert pace.head_copy(5)  # 18 ms through the copy against 20 for the whole head
    for _ in range(8):
        pace.record(4, 0.020, 5, 0.030, 4)  # the copy turns slower: the running time follows
    assert not pace.head_copy(5)
    assert pace.best(GAMMA_MAX) > 4  # every draft kept: longer checks than the one measured pay


def test_the_pace_takes_one_token_steps_where_they_were_measured_faster():
    """With a long context every draft step and every row of a check attends over all of it, and a
    round can be slower per token than one-token steps (SmolLM2 at 3000 tokens of context: 0.86x
    before this rule). The pace times speculation first, then one-token steps (a warm-up, then timed),
    takes the faster, and the other every EXPLORE steps to keep both measured."""
    pace = Pace()
    for _ in range(2):  # a warm-up, then timed: 5 drafts at 5 ms and a check of 6 rows at 20 ms, all kept
        pace.record(5, 0.025, 6, 0.020, 5)
    assert pace.plain(GAMMA_MAX)  # one-token steps not measured yet
    pace.record_plain(0.5)  # (a warm-up: not timed)
    assert pace.plain_s is None and pace.plain(GAMMA_MAX)
    pace.record_plain(0.012)  # 83 tokens/s against a round's 6 / 45 ms = 133
    decisions = [pace.plain(GAMMA_MAX) for _ in range(2 * EXPLORE)]
    assert decisions.count(True) == 2  # one-token steps only to measure them again
    for _ in range(3):
        pace.record_plain(0.004)  # 250 tokens/s
    decisions = [pace.plain(GAMMA_MAX) for _ in range(2 * EXPLORE)]
    assert decisions.count(False) == 2  # rounds only to measure them again
    assert not pace.plain(0)  # (nothing to draft: the caller's one-token step, not the pace's)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_default_may_take_one_token_steps_and_true_always_speculates(threads):
    torch.set_num_threads(threads)
    model = tiny_llama(seed=12)
    plain = _greedy(model, False, max_new_tokens=96)
    draft = model._draft_for(_prepared_cache(model)[2])
    # rounds measured very slow: so slow that the explored rounds' real times (each moving a running time 3/4 of
    # the way down) leave them slower than one-token steps through all 96 (with 1 s, a machine whose one-token
    # steps are slow, such as one under load, saw rounds faster after the fifth exploration)
    slow = 1e6
    draft.pace = Pace(draft_s=slow, check_s={(t, c): slow for t in range(1, 17) for c in (True, False)},
                      warmed={(t, c) for t in range(1, 17) for c in (True, False)})
    assert torch.equal(_greedy(model, None, max_new_tokens=96), plain)
    stats = model.speculation_stats
    assert stats["one_token"] > 60 and stats["checks"] <= 10  # (two timings, then a round every EXPLORE steps)
    draft.stats = type(draft.stats)()
    assert torch.equal(_greedy(model, True, max_new_tokens=96), plain)
    assert model.speculation_stats["one_token"] == 0 and model.speculation_stats["checks"] > 0


def test_the_share_of_drafts_kept_follows_the_recent_rounds():
    """After many rounds whose drafts all agreed (a short prompt), rounds keeping one draft of five (a
    long context, say) make the pace draft little within some 60 rounds, not hundreds."""
    pace = Pace()
    for rows in range(2, GAMMA_MAX + 2):
        for _ in range(2):  # (a warm-up, then timed)
            pace.record(rows - 1, 0.005 * (rows - 1), rows, 0.010 + 0.001 * rows, rows - 1)
    for _ in range(500):
        pace.record(5, 0.025, 6, 0.016, 5)
    assert pace.best(GAMMA_MAX, explore=False) == GAMMA_MAX
    for _ in range(60):
        pace.record(5, 0.025, 6, 0.016, 1)
    assert pace.best(GAMMA_MAX, explore=False) <= 3


def test_one_slow_check_does_not_keep_its_length_out():
    """Timing noise only adds time: a check preempted once moves its length's running time a quarter
    of the way, the next normal one most of the way back; and every EXPLORE rounds a length next to
    the best is checked (longer, then shorter), so a length measured slow is measured again."""
    pace = Pace()
    for rows in (4, 5, 6):
        pace.record(rows - 1, 0.005 * (rows - 1), rows, 0.1, rows - 1)  # warm-ups
        pace.record(rows - 1, 0.005 * (rows - 1), rows, 0.015 + 0.001 * rows, rows - 1)
    pace.record(5, 0.025, 6, 0.2, 5)  # preempted
    assert pace.check_s[6, True] == pytest.approx(0.75 * 0.021 + 0.25 * 0.2)
    pace.record(5, 0.025, 6, 0.021, 5)
    assert pace.check_s[6, True] == pytest.approx(0.25 * (0.75 * 0.021 + 0.25 * 0.2) + 0.75 * 0.021)
    pace = Pace()
    check = [0.008 * 1.25 ** rows for rows in range(GAMMA_MAX + 2)]  # a check's time grows faster the longer
    for rows in range(2, GAMMA_MAX + 2):
        for _ in range(2):  # (a warm-up, then timed)
            pace.record(rows - 1, 0.005 * (rows - 1), rows, check[rows], rows - 1)
    pace.rounds = 0
    lengths = []
    for _ in range(2 * EXPLORE):
        lengths.append(pace.best(GAMMA_MAX))
        pace.record(lengths[-1], 0.005 * lengths[-1], lengths[-1] + 1, check[lengths[-1] + 1], lengths[-1])
    usual = max(set(lengths), key=lengths.count)
    assert 1 < usual < GAMMA_MAX
    assert lengths[EXPLORE - 1] == usual + 1 and lengths[2 * EXPLORE - 1] == usual - 1
    assert lengths.count(usual) == 2 * EXPLORE - 2


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_tokens_are_plain_greedy_search(seed, threads):
    torch.set_num_threads(threads)
    model = tiny_llama(seed=seed)
    plain = _greedy(model, False)
    assert model.speculation_stats is None
    spec = _greedy(model, True)
    assert torch.equal(spec, plain)
    stats = model.speculation_stats
    assert stats["checks"] > 0 and stats["accepted"] > 0 and stats["answered_ahead"] > 0
    # fewer model steps than tokens: that is the point (the last token: a plain step, nothing to draft for)
    steps = plain.shape[1] - IDS.shape[1] - 1  # (the first token comes from the prompt's forward)
    assert steps - 1 <= stats["checks"] + stats["answered_ahead"] <= steps
    assert stats["checks"] < steps / 2


def test_a_draft_that_disagrees_changes_no_token():
    """A draft made from another model's weights proposes other tokens: each check keeps fewer, and
    the tokens stay plain greedy search's."""
    model, other = tiny_llama(seed=4), tiny_llama(seed=5)
    plain = _greedy(model, False)
    _, _, prepared = _prepared_cache(model)
    _, _, other_prepared = _prepared_cache(other)
    wrong = build_draft(other_prepared, other.model.embed_tokens, other.model.norm, other.lm_head.weight)
    model.__dict__["_self_draft"] = (weakref.ref(prepared), wrong, True)
    model.self_speculation = True
    assert torch.equal(model.generate(IDS, **KW, max_new_tokens=48), plain)
    assert model.__dict__["_self_draft"][1] is wrong
    stats = model.speculation_stats
    assert stats["accepted"] < stats["drafted"] and stats["checks"] > 0


def test_eos_stop_strings_of_criteria_and_the_returned_cache_are_plain_greedy_search():
    model = tiny_llama(seed=6)
    plain = _greedy(model, False)
    eos = int(plain[0, IDS.shape[1] + 20])  # a token greedy search gives mid-way
    a = _greedy(model, False, eos_token_id=eos, return_dict_in_generate=True)
    b = _greedy(model, True, eos_token_id=eos, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences) and a.sequences.shape[1] < plain.shape[1]
    assert b.past_key_values.lengths == a.past_key_values.lengths
    # generation continued from the returned cache: the same as from plain greedy search's
    more = dict(max_new_tokens=12, return_dict_in_generate=True)
    model.self_speculation = False
    cont_a = model.generate(a.sequences, past_key_values=a.past_key_values, **KW, **more)
    model.self_speculation = True
    cont_b = model.generate(b.sequences, past_key_values=b.past_key_values, **KW, **more)
    assert torch.equal(cont_a.sequences, cont_b.sequences)


def test_steps_that_read_the_scores_or_batches_do_not_speculate():
    model = tiny_llama(seed=7)
    model.self_speculation = True
    batch = torch.cat([IDS, IDS.flip(1)])
    model.generate(batch, **KW, max_new_tokens=8)
    model.generate(IDS, **KW, max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
    model.generate(IDS, **KW, max_new_tokens=8, logits_processor=[lambda ids, scores: scores])
    assert model.speculation_stats is None or model.speculation_stats["checks"] == 0


def test_any_other_write_drops_what_was_computed_ahead():
    model = tiny_llama(seed=8)
    plain = _greedy(model, False)
    for eos in plain[0, IDS.shape[1] + 4:].tolist():  # an EOS after which the last check kept drafts
        out = _greedy(model, True, eos_token_id=eos, return_dict_in_generate=True)
        cache = out.past_key_values
        if cache.ahead is not None:
            break
    assert isinstance(cache, KVCache) and cache.ahead is not None
    cache.crop(cache.lengths[0] - 1)
    assert cache.ahead is None
    # the continuation after a crop is plain greedy search's again
    model.self_speculation = False
    ref = model.generate(out.sequences[:, :-1], **KW, max_new_tokens=16)
    model.self_speculation = True
    again = model.generate(out.sequences[:, :-1], past_key_values=cache, **KW, max_new_tokens=16)
    assert torch.equal(again, ref)


def test_the_draft_length_stays_within_what_one_check_runs():
    model = tiny_llama(seed=9)
    _greedy(model, True, max_new_tokens=120)
    draft = model.__dict__["_self_draft"][1]
    assert 1 <= draft.gamma <= GAMMA_MAX <= 15


def test_the_default_makes_a_draft_only_up_to_its_size_limit(monkeypatch):
    from genkit.models import one_call

    model = tiny_llama(seed=10)
    plain = _greedy(model, False)
    _, _, prepared = _prepared_cache(model)
    draft = model._draft_for(prepared)  # (self_speculation False: asked directly)
    blocks = sum(lin.blocks.numel() for p in draft.decoder.layers for lin in (p.wqkv, p.wo, p.wgu, p.wd))
    head = prepared.for_rows(1)[1]  # (the float32 head a step reads: the draft's head is 4-bit, rescored on it)
    assert draft.head.bits == 4 and draft.ends.rescore == RESCORE
    assert one_call.draft_bytes(prepared, head) == blocks + draft.head.blocks.numel()
    monkeypatch.setattr(one_call, "DRAFT_MAX_BYTES", blocks)  # a limit under this model's draft
    model.__dict__.pop("_self_draft")
    assert torch.equal(_greedy(model, None), plain)
    assert model.speculation_stats is None  # no draft: one token per step
    assert torch.equal(_greedy(model, True), plain)  # True makes it whatever its size
    assert model.speculation_stats["checks"] > 0


def test_no_drafts_past_the_generation_the_cache_was_sized_for():
    """Two new tokens: the second comes from a plain step (no draft would be used)."""
    model = tiny_llama(seed=11)
    plain = _greedy(model, False, max_new_tokens=2)
    assert torch.equal(_greedy(model, True, max_new_tokens=2), plain)
    assert model.speculation_stats is None or model.speculation_stats["checks"] == 0
    three = _greedy(model, True, max_new_tokens=3)
    assert torch.equal(three, _greedy(model, False, max_new_tokens=3))
    assert model.speculation_stats["drafted"] == 1  # one draft: the most that can be used


FORCED_SCRIPT = """
import json, os, torch
from genkit.models import block_kernel, dense_kernel
from genkit.models.tiny import tiny_llama
lib = dense_kernel.library()
gen = torch.Generator().manual_seed(0)
same = True
for n, k in ((50, 37), (200, 300)):  # (AVX2's groups of rows: two vectors, one, the scalar tail; 1-3 groups)
    w = torch.randn(k, n, generator=gen).t()
    for m in (3, 5, 8, 13, 16):
        x = torch.randn(m, k, generator=gen)
        rows = torch.empty(m, n)
        lib.gk_gemv_t(x.data_ptr(), k, w.data_ptr(), n, rows.data_ptr(), m, n, k, 2)
        for i in range(m):
            alone, xi = torch.empty(1, n), x[i:i + 1].clone()
            lib.gk_gemv_t(xi.data_ptr(), k, w.data_ptr(), n, alone.data_ptr(), 1, n, k, 2)
            same = same and torch.equal(rows[i], alone[0])
model = tiny_llama(seed=2)
ids = torch.tensor([[1, 17, 33, 5, 60, 9]])
kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=40)
model.self_speculation = False
plain = model.generate(ids, **kw)
model.self_speculation = True
spec = model.generate(ids, **kw)
print(json.dumps({"rows": same, "tokens": torch.equal(plain, spec), "stats": model.speculation_stats,
                  "simd": block_kernel.library().gk_simd()}))
"""


@pytest.mark.parametrize("build", ["avx2", "portable"])
def test_forced_builds_speculate_exactly(build, tmp_path):
    """The kernels another CPU builds (GENKIT_BLOCK_KERNEL=avx2: AVX2 vectors and FMA; portable: the
    compiler's generic vectors, no FMA): a row of several is still the row alone, bit for bit, and
    self-speculative greedy search gives plain greedy search's tokens."""
    import json
    import os
    import subprocess
    import sys

    from test_block_kernel import HAS_AVX2

    if build == "avx2" and not HAS_AVX2:
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    env = {**os.environ, "GENKIT_BLOCK_KERNEL": build, "GENKIT_HOME": str(tmp_path), "GENKIT_KERNEL": "gemv",
           "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", FORCED_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["simd"] == {"avx2": 1, "portable": 0}[build]  # the build asked for
    assert got["rows"] and got["tokens"], got
    assert got["stats"]["checks"] > 0 and got["stats"]["accepted"] > 0


def test_the_draft_goes_with_the_prepared_weights_it_copies():
    model = tiny_llama(seed=12)
    _greedy(model, True, max_new_tokens=8)
    assert model.speculation_stats is not None
    model._prepared = None  # (what a dtype change or an edited weight does: the prepared weights are rebuilt)
    import gc

    gc.collect()
    assert model.__dict__["_self_draft"] is None and model.speculation_stats is None
    assert torch.equal(_greedy(model, True, max_new_tokens=8), _greedy(model, False, max_new_tokens=8))


def test_a_bad_setting_is_refused_with_the_accepted_values():
    from genkit.errors import ConfigError

    model = tiny_llama(seed=13)
    model.self_speculation = "yes"
    with pytest.raises(ConfigError, match=r"`self_speculation` must be None, True or False; got 'yes'"):
        model.generate(IDS, **KW, max_new_tokens=4)


def test_the_draft_weights_are_the_int8_quantization_made_in_c():
    """The draft's 8-bit blocks come from C (block_kernel.head_proxy's rounding); they are the blocks of
    quantize's int8 rounding but where a value lies on a rounding tie (one code apart there)."""
    from genkit.errors import ConfigError
    from genkit.models.quant import Int4Linear, _int8_symmetric
    from genkit.models.self_speculation import _int8

    w = torch.randn(96, 320, generator=torch.Generator().manual_seed(3)).t()  # (320, 96) column-major
    made = _int8(w)
    ref = Int4Linear(96, 320, _int8_symmetric(w), kernel="blocks")
    assert made.blocks.shape == ref.blocks.shape and made.bits == 8 and made.symmetric
    differ = made.blocks != ref.blocks
    assert differ.float().mean() < 1e-3
    assert ((made.blocks.int() - ref.blocks.int()).abs()[differ] == 1).all()
    with pytest.raises(ConfigError, match=r"blocks of shape \(20, 3, 576\) do not hold a \(320, 64\) 8-bit weight"):
        Int4Linear.from_blocks(made.blocks, 64, 320, 8, True)


def test_true_where_nothing_can_speculate_says_so_once(monkeypatch, caplog):
    import logging

    from genkit.models import kernel_choice

    monkeypatch.setenv(kernel_choice.ENV, "decode:plain")  # torch's linear: no one-call decoder
    kernel_choice.CHOSEN.clear()
    model = tiny_llama(seed=14)
    plain = _greedy(model, False, max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="genkit.models"):
        assert torch.equal(_greedy(model, True, max_new_tokens=8), plain)
        _greedy(model, True, max_new_tokens=8)
    said = [r.getMessage() for r in caplog.records if "self_speculation=True" in r.getMessage()]
    assert len(said) == 1 and "GENKIT_KERNEL=decode:gemv" in said[0] and "one token per step" in said[0]
    assert model.speculation_stats is None


def test_threads_speculating_on_one_model_get_their_own_tokens():
    """Four threads generate greedily on one float32 model at once, each speculating (the draft made
    by whichever gets there first, its pace shared): each gets plain greedy search's tokens."""
    from test_greedy_step import generate_at_once

    model = tiny_llama(seed=15, vocab_size=512)
    prompts = [IDS + i for i in range(4)]
    alone = []
    for p in prompts:
        model.self_speculation = False
        alone.append(model.generate(p, max_new_tokens=40, **KW))
    model._prepared = None  # prepared weights and draft made again, by the racing threads
    model.self_speculation = True
    got = generate_at_once(model, prompts, max_new_tokens=40, **KW)
    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    assert model.speculation_stats["checks"] > 0


def test_a_model_with_biased_projections_speculates_exactly():
    """Biased q/k/v and o products (Qwen2's, ``attention_bias``) run in the one-call step, the draft's
    8-bit copies with the same float32 biases: plain greedy search's tokens, drafts kept."""
    model = tiny_llama(seed=3, attention_bias=True)
    plain = _greedy(model, False)
    spec = _greedy(model, True)
    assert torch.equal(spec, plain)
    stats = model.speculation_stats
    assert stats["checks"] > 0 and stats["accepted"] > 0


@pytest.mark.parametrize("vocab", [160, 163])
def test_gpt2_speculates_exactly_with_its_learned_positions(tmp_path, vocab):
    """GPT-2 on the one-call decoder (LayerNorms, biases, GELU, its learned positions added to each
    row's embedding in the kernel): the 8-bit draft and the check give plain greedy search's tokens,
    which are transformers' on the same weights. A vocabulary that is not a multiple of 16 (GPT-2's
    50,257; 163 here) gets a draft head padded with rows of zeros, which its steps never choose."""
    transformers = pytest.importorskip("transformers")
    import genkit

    torch.manual_seed(1234)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, initializer_range=0.1)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = genkit.load_model(str(tmp_path))
    ref = hf.generate(IDS, do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=0)
    plain = _greedy(model, False, max_new_tokens=64)
    assert torch.equal(plain, ref) and model.speculation_stats is None
    assert torch.equal(_greedy(model, True, max_new_tokens=64), ref)
    stats = model.speculation_stats
    assert stats["checks"] > 0 and stats["accepted"] > 0 and stats["answered_ahead"] > 0
    draft = model.__dict__["_self_draft"][1]
    assert (draft.head.out_features, draft.head.panel_rows) == (vocab, 16 * -(-vocab // 16))
    assert draft.ends.outputs == draft.head.panel_rows and draft.ends.live == vocab
