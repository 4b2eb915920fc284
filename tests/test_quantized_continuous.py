"""issue 32 item 3, quantized continuous batching: on a GGUF model whose projections run on the block
kernel, a step in which every request decodes one token is one ``gk_decode_paged`` call over the
paged store; its tokens equal greedy ``generate`` on each prompt alone, and the step's hidden states
and written keys/values equal the torch path's (the same block-kernel products per matrix)."""

from __future__ import annotations

import random

import pytest
import torch
from test_quantized import write_quantized_gguf
from tolerance import U_BLOCK_ACTIVATION_NORM, hidden_bound, norm_and_head_bound

import genkit
from genkit.continuous import ContinuousBatchingConfig
from genkit.models import block_kernel
from genkit.models.paged import StepBatch, _paged_layers, paged_forward

pytestmark = pytest.mark.skipif(not block_kernel.available() or not block_kernel.simd(),
                                reason="no C compiler or vector path for the block kernel on this CPU")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qcb") / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    m = genkit.load_model(path)
    assert m.model.layers[0].self_attn.q_proj.kernel == "blocks"
    return m


def _prompts(n, seed=0, low=1, high=30):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.mark.parametrize("chunk", [None, 4])
def test_quantized_generate_batch_equals_greedy_generate(model, chunk):
    prompts = _prompts(12)
    config = genkit.GenerationConfig(prefill_chunk_size=chunk, continuous_batching_config=ContinuousBatchingConfig(
        block_size=8, num_blocks=128, max_batch_tokens=48).to_dict())
    results = model.generate_batch(prompts, config, max_new_tokens=12, do_sample=False, eos_token_id=None)
    for out, prompt in zip(results.values(), prompts):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.generated_tokens == ref[0, len(prompt):].tolist()


def _prefilled(model, prompts, block_size=4):
    store = model.new_paged_store(block_size=block_size, num_blocks=64)
    blocks, nxt = [], 0
    for p in prompts:
        n = -(-(len(p) + 3) // block_size)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n
    ids = torch.tensor([t for p in prompts for t in p])
    spans, start = [], 0
    for p in prompts:
        spans.append((start, len(p)))
        start += len(p)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    paged_forward(model, store, StepBatch(ids, positions, spans, [0] * len(prompts), blocks, [True] * len(prompts)))
    return store, blocks


def test_the_fused_decode_step_equals_the_torch_step(model):
    prompts = [[5, 9, 11], [7, 3, 3, 3, 8, 1, 2], [40]]
    store, blocks = _prefilled(model, prompts)
    twin, _ = _prefilled(model, prompts)
    prepared = store.prepared
    assert prepared.decoder is not None
    cached = [len(p) for p in prompts]
    batch = StepBatch(torch.tensor([17, 18, 19]), torch.tensor(cached), [(0, 1), (1, 1), (2, 1)], cached, blocks,
                      [True] * 3)
    with torch.inference_mode():
        x = model.model.embed_tokens(batch.ids)
        cos_t, sin_t = model._rope_table(max(cached) + 1, x.dtype)
        cos, sin = cos_t[batch.positions], sin_t[batch.positions]
        fused = prepared.decoder.paged(x, cos, sin, batch.positions, store, blocks)
        ref = _paged_layers(prepared, twin, batch, x[None], cos, sin, model.dtype)[0]
    # the same products, attention summed in another order: where that moves an activation across a
    # rounding boundary of its second int8 digit, the value moves by 1/64,516 of its block's largest
    assert fused is not None
    config, seq, layers = model.config, max(cached) + 1, len(prepared.layers)
    torch.testing.assert_close(fused, ref, rtol=0, atol=hidden_bound(config, seq, layers, ref,
                                                                     linear_u=U_BLOCK_ACTIVATION_NORM))
    for i in range(layers):
        for got, want in ((store.keys[i], twin.keys[i]), (store.values[i], twin.values[i])):
            assert bool(got.any())  # the step wrote its keys and values
            atol = hidden_bound(config, seq, i + 1, want, linear_u=U_BLOCK_ACTIVATION_NORM)
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    with torch.inference_mode():  # and the logits of the whole step, through paged_forward
        logits = paged_forward(model, twin, StepBatch(batch.ids, batch.positions, batch.spans, cached,
                                                      blocks, [True] * 3))
    assert logits.shape == (3, model.config.vocab_size)


def test_the_fused_step_checks_a_store_again_when_its_buffers_change(model):
    """The decoder keeps a paged store's checked pointer arrays between steps; a buffer replaced
    since is checked again: one the kernel cannot take sends the step the torch way (None), and a new
    float32 buffer is written where it now is, the old one no longer."""
    store, blocks = _prefilled(model, [[5, 9, 11]])
    decoder = store.prepared.decoder

    def step(pos):
        with torch.inference_mode():
            x = model.model.embed_tokens(torch.tensor([17]))
            cos_t, sin_t = model._rope_table(pos + 1, x.dtype)
            positions = torch.tensor([pos])
            return decoder.paged(x, cos_t[positions], sin_t[positions], positions, store, blocks)

    assert step(3) is not None
    old = store.keys[0]
    store.keys[0] = old.double()
    assert step(4) is None
    store.keys[0] = torch.zeros_like(old)
    assert step(4) is not None
    block, offset = blocks[0][1], 0  # position 4 with blocks of 4
    assert bool(store.keys[0][block, offset].any()) and not bool(store.keys[0][blocks[0][0]].any())
    assert not bool(old[block, offset].any()) and bool(old[blocks[0][0]].any())


def _step(ids, spans, cached, blocks):
    positions = torch.cat([torch.arange(c, c + n) for (_, n), c in zip(spans, cached)])
    return StepBatch(torch.tensor(ids), positions, spans, cached, blocks, [True] * len(spans))


def test_prompt_chunks_and_mixed_steps_run_fused_and_equal_the_torch_step(model):
    """Any step, prompt chunks included, is one ``gk_decode_paged`` call (each token a row at its
    own position with its request's blocks): its hidden states and keys/values equal the torch
    path's, a prompt's rows attending to each other causally; and paged_forward's logits are those
    of the fused hidden states, through the final norm and LM head as the decoder runs them (within
    the bound of two norms' orders of the modules'). On main a step holding a prompt chunk took the torch path."""
    prepared = model.new_paged_store(block_size=4, num_blocks=64).prepared
    stores = [model.new_paged_store(block_size=4, num_blocks=64) for _ in range(3)]  # fused, torch, paged_forward
    blocks = [[0, 1, 2], [3, 4, 5, 6], [7, 8]]
    steps = [_step([5, 9, 11, 7, 3, 3, 3, 8, 40], [(0, 3), (3, 5), (8, 1)], [0, 0, 0], blocks),  # three prompts
             _step([17, 2, 1, 6, 18], [(0, 1), (1, 3), (4, 1)], [3, 5, 1], blocks)]  # decoding rows + a chunk
    config, layers = model.config, len(prepared.layers)
    for batch in steps:
        rows = [b for b, (_, n) in zip(batch.blocks, batch.spans) for _ in range(n)]
        with torch.inference_mode():
            x = model.model.embed_tokens(batch.ids)
            cos_t, sin_t = model._rope_table(int(batch.positions.max()) + 1, x.dtype)
            cos, sin = cos_t[batch.positions], sin_t[batch.positions]
            fused = prepared.decoder.paged(x, cos, sin, batch.positions, stores[0], rows)
            ref = _paged_layers(prepared, stores[1], batch, x[None], cos, sin, model.dtype)[0]
            logits = paged_forward(model, stores[2], batch)
        seq = int(batch.positions.max()) + 1
        torch.testing.assert_close(fused, ref, rtol=0, atol=hidden_bound(config, seq, layers, ref,
                                                                         linear_u=U_BLOCK_ACTIVATION_NORM))
        for i in range(layers):
            for got, want in ((stores[0].keys[i], stores[1].keys[i]), (stores[0].values[i], stores[1].values[i])):
                atol = hidden_bound(config, seq, i + 1, want, linear_u=U_BLOCK_ACTIVATION_NORM)
                torch.testing.assert_close(got, want, rtol=0, atol=atol)
        last = torch.tensor([s + n - 1 for s, n in batch.spans])
        with torch.inference_mode():
            h = fused.index_select(0, last)
            kernel = prepared.decoder.final_logits(h, model.kernel_ends(prepared))
            normed = model.model.norm(h)
            modules = model.lm_head(normed).float()
            w = model.lm_head(torch.eye(h.shape[1])).t()
        assert torch.equal(logits, kernel)  # the decoder's final norm and head, as in generate's one-call step
        assert ((logits - modules).abs() <= norm_and_head_bound(normed, w)).all()
