"""Native models vs transformers on the same weights (saved by transformers' save_pretrained).

Tiny random Llama (GQA, tied and untied), Qwen2 (q/k/v bias), Qwen3 (per-head q/k norms, with
random weights; explicit head_dim, attention_bias, tied, linear rope scaling, sliding windows), Mistral,
Llama-3 rope scaling and GPT-2 (Conv1D weights): logits with padding and with incremental decoding through the cache, and
64-token greedy generations.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import U_BF16, hidden_bound, logits_bound, unit_roundoff

import genkit
from genkit.models.llama_infer import packing_available

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "initializer_range": 0.1}

CONFIGS = {
    "llama_gqa_untied": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "llama_gqa_tied": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=True,
                                                       rms_norm_eps=1e-5, rope_theta=500000.0),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    # sliding-window attention: every layer (Mistral), layers from max_window_layers on (Qwen2)
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=5),
    "qwen2_window": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2, use_sliding_window=True,
                                                     sliding_window=5, max_window_layers=1),
    # Qwen3: head_dim 128 by default (not hidden_size / heads = 16); q_norm/k_norm (made random in _hf_model)
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3_tied_bias": lambda: transformers.Qwen3Config(
        **COMMON, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}),
    "qwen3_window": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32,
                                                     use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                            initializer_range=0.1),
    # per-layer attention scale, exact GELU, an explicit MLP width and LayerNorm epsilon (the inference path's
    # PreparedLayer carries each)
    "gpt2_scaled": lambda: transformers.GPT2Config(vocab_size=160, n_embd=64, n_layer=3, n_head=4, n_positions=256,
                                                   n_inner=96, activation_function="gelu", layer_norm_epsilon=1e-3,
                                                   scale_attn_by_inverse_layer_idx=True, bos_token_id=1,
                                                   eos_token_id=2, pad_token_id=0, initializer_range=0.1),
}


def _hf_class(cfg):
    return {"gpt2": transformers.GPT2LMHeadModel}.get(cfg.model_type, transformers.AutoModelForCausalLM)


def _hf_model(cfg):
    """transformers' model for ``cfg``, its Qwen3 q/k norms random (transformers makes them ones, which
    would leave a norm applied to the wrong heads, or not at all, unseen)."""
    cls = _hf_class(cfg)
    hf = (cls(cfg) if cls is not transformers.AutoModelForCausalLM else cls.from_config(cfg)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.5)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    torch.manual_seed(1234)
    cfg = CONFIGS[request.param]()
    hf = _hf_model(cfg)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = genkit.load_model(path)
    return request.param, hf, ours


def _padded_batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 160, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _positions(mask):
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def test_tied_weights_follow_config(pair):
    name, hf, ours = pair
    emb = ours.transformer.wte.weight if name.startswith("gpt2") else ours.model.embed_tokens.weight
    assert (ours.lm_head.weight.data_ptr() == emb.data_ptr()) == bool(hf.config.tie_word_embeddings)


def test_logits_match_with_padding(pair):
    _name, hf, ours = pair
    ids, mask = _padded_batch()
    pos = _positions(mask)
    ref = hf(ids, attention_mask=mask, position_ids=pos).logits
    out = ours(ids, attention_mask=mask).logits  # positions derived from the mask
    real = mask.bool()
    assert out.shape == ref.shape
    torch.testing.assert_close(out[real], ref[real], atol=logits_bound(ours, ids, mask), rtol=0)
    # logits_to_keep=1 gives the last position only
    last = ours(ids, attention_mask=mask, logits_to_keep=1).logits
    assert last.shape == (3, 1, ref.shape[-1])
    torch.testing.assert_close(last[:, 0], ref[:, -1], atol=logits_bound(ours, ids, mask), rtol=0)


def test_incremental_decoding_matches_full_forward(pair):
    _name, hf, ours = pair
    ids, mask = _padded_batch()
    g = torch.Generator().manual_seed(3)
    extra = torch.randint(3, 160, (3, 6), generator=g)
    full_ids = torch.cat([ids, extra], 1)
    full_mask = torch.cat([mask, torch.ones_like(extra)], 1)
    ref = hf(full_ids, attention_mask=full_mask, position_ids=_positions(full_mask)).logits

    cache = ours.new_cache(32)
    out = ours(ids, attention_mask=mask, past_key_values=cache)
    steps = [out.logits[:, -1]]
    for i in range(extra.shape[1]):
        n = ids.shape[1] + i + 1
        out = ours(full_ids[:, n - 1:n], attention_mask=full_mask[:, :n], past_key_values=out.past_key_values,
                   position_ids=_positions(full_mask[:, :n])[:, -1:])
        steps.append(out.logits[:, -1])
    assert cache.get_seq_length() == full_ids.shape[1]
    got = torch.stack(steps, 1)
    torch.testing.assert_close(got, ref[:, ids.shape[1] - 1:], atol=logits_bound(ours, full_ids, full_mask), rtol=0)


def test_hidden_states_match(pair):
    _name, hf, ours = pair
    ids = torch.tensor([[1, 5, 9, 33, 70, 101]])
    ref = hf(ids, output_hidden_states=True).hidden_states
    out = ours(ids, output_hidden_states=True).hidden_states
    assert len(out) == len(ref) == ours.config.num_hidden_layers + 1
    for depth, (a, b) in enumerate(zip(out, ref)):  # embeddings, each layer's output, normalised
        torch.testing.assert_close(a, b, atol=hidden_bound(ours.config, ids.shape[1], min(depth, len(out) - 2), b), rtol=0)


def test_greedy_64_tokens_identical(pair):
    _name, hf, ours = pair
    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    ref = hf.generate(prompt, do_sample=False, max_new_tokens=64, min_new_tokens=64)
    out = ours.generate(prompt, max_new_tokens=64, min_new_tokens=64)
    assert out.shape == (1, 70)
    assert torch.equal(out, ref)


def test_greedy_64_tokens_identical_with_packed_weights(pair):
    name, hf, ours = pair
    ids, mask = _padded_batch()
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64, min_new_tokens=64)
    ours.cpu_weight_packing = True
    try:
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64)
        assert ours.weights_packed is packing_available()
        assert (ours._prepared[1].head is not None) is packing_available()
    finally:
        ours.cpu_weight_packing = None
    assert torch.equal(out, ref)


def test_greedy_64_tokens_identical_left_padded(pair):
    _name, hf, ours = pair
    ids, mask = _padded_batch()
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=64, min_new_tokens=64)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64)
    assert torch.equal(out, ref)


def test_lm_head_logits_is_norm_then_head(pair):
    name, _hf, ours = pair
    ids = torch.tensor([[1, 5, 9, 33]])
    out = ours(ids, output_hidden_states=True)
    # hidden_states[-1] is already normalised (as in transformers): run the last layer by hand on
    # its input and check that lm_head_logits (final norm + head) of its output gives the logits
    layers = ours.transformer.h if name.startswith("gpt2") else ours.model.layers
    x = out.hidden_states[-2]
    mask = None
    if name.startswith("gpt2"):
        last = layers[-1](x, mask, None)
    else:
        cos, sin = ours.rope(None, x.dtype, 0, x.shape[1])
        last = layers[-1](x, cos, sin, mask, None)
    torch.testing.assert_close(ours.lm_head_logits(last), out.logits, atol=logits_bound(ours, ids), rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_generates(tmp_path, dtype, caplog):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(CONFIGS["llama_gqa_untied"]()).eval()
    hf.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="genkit.models"):
        ours = genkit.load_model(tmp_path, dtype=dtype)
    # bfloat16 on a CPU without native bfloat16 kernels is emulated (several times slower): a warning says so
    emulated = dtype == torch.bfloat16 and not packing_available(torch.bfloat16)
    assert ("bfloat16 on this CPU has no native kernels" in caplog.text) is emulated
    assert ours.dtype == dtype and ours.inv_freq.dtype == torch.float32
    ref = genkit.load_model(tmp_path, dtype="float32")
    ids = torch.tensor([[1, 17, 42, 99]])
    a = ours(ids).logits.float()
    b = ref(ids).logits
    # the weights rounded to dtype (one rounding per linear layer's terms) and every stored tensor rounded
    u = unit_roundoff(dtype)
    assert (a - b).abs().max() <= logits_bound(ref, ids, store_u=u, linear_u=u)
    out = ours.generate(ids, max_new_tokens=5, eos_token_id=None)
    assert out.shape == (1, 9)


def test_sharded_checkpoint_loads(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(CONFIGS["llama_gqa_untied"]()).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    ours = genkit.load_model(tmp_path)
    ids = torch.tensor([[1, 17, 42, 99]])
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=logits_bound(ours, ids), rtol=0)


@pytest.mark.parametrize("packing", [None, True], ids=["plain", "packed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inference_path_matches_module_path(name, packing, tmp_path):
    """Without grad, the Llama family and GPT-2 run their prepared weights (fused; oneDNN-packed when
    forced, as bigger models are by default); with grad, the modules."""
    torch.manual_seed(1234)
    cfg = CONFIGS[name]()
    _hf_model(cfg).save_pretrained(tmp_path)
    ours = genkit.load_model(tmp_path)
    ours.cpu_weight_packing = packing
    ids, mask = _padded_batch()
    real = mask.bool()
    module_cache = ours.new_cache()
    with torch.enable_grad():  # grad enabled: the modules run (the test session runs under no_grad)
        ref = ours(ids, attention_mask=mask, past_key_values=module_cache).logits
    assert module_cache.prepared is None
    with torch.inference_mode():
        cache = ours.new_cache(16)
        got = ours(ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache).logits
        assert cache.prepared is not None and cache.prepared[1] is not None  # the inference path ran
        # tiny matrices are packed only when forced (a packed call costs more than it gains there)
        assert cache.prepared[1]().layers[0].packed is (packing is True and packing_available())
        steps = [got]
        for n in range(9, 13):
            steps.append(ours(ids[:, n - 1:n], attention_mask=mask[:, :n], past_key_values=cache,
                              position_ids=_positions(mask[:, :n])[:, -1:]).logits)
    got = torch.cat(steps, 1)
    torch.testing.assert_close(got[real], ref[real].detach(), atol=logits_bound(ours, ids, mask), rtol=0)


def test_inference_path_follows_weight_edits_and_hooks(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(CONFIGS["llama_gqa_untied"]()).save_pretrained(tmp_path)
    ours = genkit.load_model(tmp_path)
    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    before = ours.generate(prompt, max_new_tokens=12, min_new_tokens=12)
    with torch.no_grad():  # edit weights in place: the prepared copies must follow
        ours.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
        ours.model.layers[0].input_layernorm.weight.add_(0.5)
        ours.model.layers[0].self_attn.k_proj.weight.mul_(2.0)  # a view into the fused q/k/v storage
    after = _follows_edits_and_hooks(ours, prompt, before, ours.model.layers[0].mlp)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: seen.append(type(mod).__name__))
    try:
        hooked = ours.generate(prompt, max_new_tokens=2, min_new_tokens=2)
    finally:
        handle.remove()
    assert seen.count("LlamaDecoderLayer") == 2 * 2  # a global hook also sees every layer call
    assert torch.equal(hooked, after[:, :8])

    # training after generate(): tables and caches built in inference mode must not leak into autograd
    with torch.enable_grad():
        ours.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
        ours(after).logits.sum().backward()
    assert ours.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def _follows_edits_and_hooks(ours, prompt, before, mlp):
    """After in-place weight edits: 12 greedy tokens that differ from ``before``, equal to the same
    decode through the modules (grad enabled, no cache); a forward hook on ``mlp`` makes generation
    run the modules (called at the prompt and each decode step) with the same tokens. Returns them."""
    after = ours.generate(prompt, max_new_tokens=12, min_new_tokens=12)
    assert not torch.equal(before, after)
    ref = prompt
    with torch.enable_grad():
        for _ in range(12):
            ref = torch.cat([ref, ours(ref, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(after, ref)
    calls = []
    handle = mlp.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    try:
        hooked = ours.generate(prompt, max_new_tokens=5, min_new_tokens=5)
    finally:
        handle.remove()
    assert len(calls) == 5  # prompt + 4 decode steps
    assert torch.equal(hooked, after[:, :11])
    return after


def _force_route(route, tmp_path, monkeypatch):
    """Every product of a model loaded next on ``route`` (GENKIT_KERNEL; the choice cache in
    ``tmp_path``); a skip where this machine has no such route."""
    from genkit.models import dense_kernel, kernel_choice

    if route == "packed" and not packing_available():
        pytest.skip("oneDNN cannot pack float32 weights on this CPU/build: only the plain path exists here")
    if route == "gemv" and not dense_kernel.available():
        pytest.skip("no C compiler: genkit's gemv kernel does not exist here (tests/test_dense_kernel.py)")
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(kernel_choice.ENV, route)
    kernel_choice.CHOSEN.clear()


def _gpt2_pair(folder):
    torch.manual_seed(1234)
    hf = _hf_model(CONFIGS["gpt2"]())
    hf.save_pretrained(folder)
    return hf, genkit.load_model(folder)


@pytest.mark.parametrize("route", ["plain", "packed", "gemv"])
def test_gpt2_on_each_product_route_gives_transformers_tokens(route, tmp_path, monkeypatch):
    """GPT-2's blocks on the inference path, each product route forced (GENKIT_KERNEL): the Conv1D
    weights' transposes as they are (plain, gemv: no copy) or oneDNN-packed copies, with the
    LayerNorms, biases and GELU around them; batch-1 decode (the decode class), a left-padded batch
    (small) and its prompts (prefill) give transformers' greedy tokens."""
    from genkit.models import dense_kernel, kernel_choice

    _force_route(route, tmp_path, monkeypatch)
    hf, ours = _gpt2_pair(tmp_path / "gpt2")
    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    ref = hf.generate(prompt, do_sample=False, max_new_tokens=64, min_new_tokens=64)
    assert torch.equal(ours.generate(prompt, max_new_tokens=64, min_new_tokens=64), ref)
    ids, mask = _padded_batch()
    ref = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=32, min_new_tokens=32)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32), ref)
    for cls in kernel_choice.CLASSES:
        layer = ours._prepared[1].routes[cls][0][0]
        assert layer.packed is (route == "packed")
        assert (type(layer.wqkv) is dense_kernel.Gemv) is (route == "gemv")
    plain = ours._prepared[1].routes["decode"][0][0].wqkv
    if route != "packed":  # c_attn's (in, out) storage read as it is
        weight = plain.weight if route == "gemv" else plain
        assert weight.data_ptr() == ours.transformer.h[0].attn.c_attn.weight.data_ptr()


@pytest.mark.parametrize("name,route", [("gpt2", "plain"), ("gpt2", "packed"), ("gpt2", "gemv"),
                                        ("gpt2_scaled", "plain"), ("gpt2_scaled", "gemv")])
def test_gpt2s_continuous_batching_gives_transformers_tokens(name, route, tmp_path, monkeypatch):
    """GPT-2 runs continuous batching (the paged forward; it was refused by name): its learned
    positions added at each token's own position, no rotary tables, each layer's attention scale
    (``scale_attn_by_inverse_layer_idx``) in the paged attention (SDPA for prompt chunks, the block
    kernel in place for decoding rows), the final LayerNorm; every request's greedy tokens are
    transformers' on its prompt alone, with prompts split into chunks and requests joining mid-way
    (``max_batch_tokens``), on each product route (gemv: the one-call step where the route allows)."""
    from genkit.continuous import ContinuousBatchingConfig

    _force_route(route, tmp_path, monkeypatch)
    torch.manual_seed(1234)
    hf = _hf_model(CONFIGS[name]())
    hf.save_pretrained(tmp_path / name)
    ours = genkit.load_model(tmp_path / name)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (1, 6, 23, 9, 40)]
    want = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, len(p):].tolist()
            for p in prompts]
    config = genkit.GenerationConfig(continuous_batching_config=ContinuousBatchingConfig(
        block_size=8, num_blocks=64, max_batch_tokens=24).to_dict())
    got = ours.generate_batch(prompts, config, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert [out.generated_tokens for out in got.values()] == want


def test_gpt2s_paged_steps_give_transformers_logits_with_each_layers_scale(tmp_path):
    """GPT-2's paged steps with a per-layer attention scale (1/2, 1/3 after the first layer's): a
    first step of one whole prompt and another's first chunk, then one of a decoding row (attended
    in place on the block kernel, or gathered for SDPA) and the rest of the chunked prompt (SDPA over
    its cached and new positions): each wanted row's logits are transformers' on the whole sequence,
    within the float32 bound."""
    from genkit.models.paged import StepBatch, paged_forward

    torch.manual_seed(1234)
    hf = _hf_model(CONFIGS["gpt2_scaled"]())
    hf.save_pretrained(tmp_path / "gpt2")
    ours = genkit.load_model(tmp_path / "gpt2")
    a, b = [5, 17, 42, 99, 23], [7, 3, 88, 150, 61, 9, 12]
    store = ours.new_paged_store(block_size=4, num_blocks=16)
    blocks = [[0, 1], [2, 3]]
    first = StepBatch(torch.tensor(a + b[:4]), torch.tensor([*range(5), *range(4)]), [(0, 5), (5, 4)], [0, 0],
                      blocks, [True, False])
    second = StepBatch(torch.tensor([31] + b[4:]), torch.tensor([5, 4, 5, 6]), [(0, 1), (1, 3)], [5, 4], blocks,
                       [True, True])
    with torch.no_grad():
        got = [paged_forward(ours, store, first), paged_forward(ours, store, second)]
        want_a, want_b = hf(torch.tensor([a + [31]])).logits[0], hf(torch.tensor([b])).logits[0]
    assert got[0].shape == (1, 160) and got[1].shape == (2, 160)
    for row, ref, ids in ((got[0][0], want_a[4], a), (got[1][0], want_a[5], a + [31]), (got[1][1], want_b[6], b)):
        torch.testing.assert_close(row, ref, atol=logits_bound(ours, torch.tensor([ids])), rtol=0)


def test_gpt2s_context_bounds_generation_and_the_server_as_transformers_names_it(tmp_path):
    """GPT-2's context is ``n_positions``; transformers' GPT2Config also reads it as
    ``max_position_embeddings``, the name generate(), continuous batching and ``genkit serve`` bound
    requests by: past it, a ConfigError naming max_new_tokens and the most that fit (not an IndexError
    from the position table), and the server's default max_model_len is that context."""
    from genkit.errors import ConfigError
    from genkit.serve.limits import default_max_model_len

    hf, ours = _gpt2_pair(tmp_path / "gpt2")
    assert ours.config.max_position_embeddings == hf.config.max_position_embeddings == 256
    assert default_max_model_len(ours, None) == 256
    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    with pytest.raises(ConfigError, match=r"`max_new_tokens` \(251\).*context \(`max_position_embeddings`\) is 256: "
                                          r"ask for at most 250 new tokens"):
        ours.generate(prompt, max_new_tokens=251)
    assert ours.generate(prompt, max_new_tokens=250, min_new_tokens=250).shape == (1, 256)


def test_gpt2_inference_path_follows_weight_edits_hooks_and_training(tmp_path):
    hf, ours = _gpt2_pair(tmp_path)
    ours.cpu_weight_packing = True  # packed copies too: an edit must reach them
    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    before = ours.generate(prompt, max_new_tokens=12, min_new_tokens=12)
    assert ours.weights_packed is packing_available()
    with torch.no_grad():  # edit weights in place: the prepared weights must follow
        ours.transformer.h[1].mlp.c_proj.weight.mul_(-3.0)
        ours.transformer.h[0].ln_1.bias.add_(0.5)
        ours.transformer.h[0].attn.c_attn.bias.mul_(4.0)
    after = _follows_edits_and_hooks(ours, prompt, before, ours.transformer.h[0].mlp)
    # training after generate(): the tied head/embedding laid out column-major is contiguous again
    ours.generate(prompt, max_new_tokens=2)
    assert not ours.transformer.wte.weight.is_contiguous()
    with torch.enable_grad():
        ours(after).logits.sum().backward()
    assert ours.transformer.wte.weight.is_contiguous() and ours.transformer.wte.weight.grad.abs().sum() > 0


def test_inference_layout_shares_storage_and_keeps_values(tmp_path):
    """The inference path fuses q/k/v and gate/up into shared storages the parameters become views of:
    no weight is held twice, and every parameter keeps its values."""
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(CONFIGS["qwen2"]()).save_pretrained(tmp_path)
    ours = genkit.load_model(tmp_path)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=3)
    after = ours.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    attn = ours.model.layers[0].self_attn
    storage = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == storage
    assert attn.v_proj.bias.untyped_storage().data_ptr() == attn.q_proj.bias.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ours.parameters()}
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in ours.parameters())
    assert attn.o_proj.weight.stride() == (1, attn.o_proj.weight.shape[0])  # column-major on the CPU


def test_packed_model_and_cache_can_be_copied_and_saved(tmp_path):
    """deepcopy / torch.save of a model with packed weights, and the prompt-cache reuse recipe of
    transformers' docs (``past_key_values=copy.deepcopy(prompt_cache)``)."""
    import copy
    import io

    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=3)
    model.cpu_weight_packing = True
    prompt = torch.tensor([[1, 5, 9, 17]])
    ref = model.generate(prompt, max_new_tokens=6)
    assert model.weights_packed is packing_available()

    twin = copy.deepcopy(model)
    assert torch.equal(twin.generate(prompt, max_new_tokens=6), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False).generate(prompt, max_new_tokens=6), ref)

    prompt_cache = model.new_cache(32)
    with torch.no_grad():
        model(prompt[:, :3], past_key_values=prompt_cache)
    for _ in range(2):  # the same cached prefix twice, each time on a copy
        out = model.generate(prompt, past_key_values=copy.deepcopy(prompt_cache), max_new_tokens=6)
        assert torch.equal(out, ref)
    assert prompt_cache.get_seq_length() == 3


def test_prompt_cache_reuse_matches_transformers(pair):
    """transformers' docs recipe: prefill a shared prefix once, then generate from copies of that cache."""
    import copy

    _name, hf, ours = pair
    prefix = torch.tensor([[1, 17, 42, 99]])
    prompt = torch.cat([prefix, torch.tensor([[5, 23]])], 1)
    hf_cache = transformers.DynamicCache(config=hf.config)
    hf(prefix, past_key_values=hf_cache)
    ref = hf.generate(prompt, past_key_values=copy.deepcopy(hf_cache), do_sample=False, max_new_tokens=20,
                      min_new_tokens=20)
    cache = ours.new_cache()
    ours(prefix, past_key_values=cache)
    out = ours.generate(prompt, past_key_values=copy.deepcopy(cache), max_new_tokens=20, min_new_tokens=20)
    assert torch.equal(out, ref)
    assert torch.equal(out, ours.generate(prompt, max_new_tokens=20, min_new_tokens=20))
    beams = ours.generate(prompt, past_key_values=copy.deepcopy(cache), num_beams=3, max_new_tokens=8)
    assert torch.equal(beams, ours.generate(prompt, num_beams=3, max_new_tokens=8))
    with pytest.raises(ValueError, match=r"`past_key_values` already holds 4 positions but `input_ids` has 4"):
        ours.generate(prefix, past_key_values=copy.deepcopy(cache), max_new_tokens=2)


def test_compiled_model_runs_its_modules(tmp_path, monkeypatch):
    """torch.compile (inductor) of a Llama-family model: preparing the inference path edits parameters
    in place and inductor cannot lower oneDNN-packed weights, so compiled calls run the modules."""
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor needs a C++ compiler")
    from genkit.models.tiny import tiny_llama

    # inductor's own cache: its key leaves out the vector ISA ATen runs (ATEN_CPU_CAPABILITY), so kernels
    # cached by a run with another one gave NaNs or corrupted the heap here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    model = tiny_llama(seed=1)
    model.cpu_weight_packing = True
    ids = torch.tensor([[1, 17, 42, 99, 5, 23]])
    with torch.enable_grad():
        ref = model(ids, use_cache=False).logits.detach()
    model.generate(ids, max_new_tokens=2)  # eager: weights laid out (and packed where oneDNN is)
    compiled = torch.compile(model)
    torch.testing.assert_close(compiled(ids).logits, ref, atol=logits_bound(model, ids), rtol=0)
    cache = model.new_cache()
    model(ids[:, :5], past_key_values=cache)  # an eager prefill: the cache holds the packed LM head
    step = compiled(ids[:, 5:], past_key_values=cache).logits
    torch.testing.assert_close(step[:, -1], ref[:, -1], atol=logits_bound(model, ids), rtol=0)
    with torch.enable_grad():  # compiled training step after a generation (the layout is undone eagerly)
        model.generate(ids, max_new_tokens=2)
        logits = compiled(ids, use_cache=False).logits
        logits.sum().backward()
    torch.testing.assert_close(logits.detach(), ref, atol=logits_bound(model, ids), rtol=0)


def test_bfloat16_runs_on_packed_weights_like_its_modules():
    """A bfloat16 model on the CPU runs oneDNN-packed bfloat16 weights on the inference path; its
    logits are the module path's within bfloat16 rounding, and greedy tokens agree."""
    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=3).to(torch.bfloat16)
    model.cpu_weight_packing = True
    ids = torch.tensor([[1, 17, 42, 99, 5, 6]])
    with torch.enable_grad():  # the modules
        ref = model(ids, use_cache=False).logits.detach().float()
    with torch.inference_mode():
        cache = model.new_cache()
        got = model(ids, past_key_values=cache).logits.float()
    # packed where the CPU has oneDNN's bfloat16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), else plain
    assert cache.prepared[1]().layers[0].packed is packing_available(torch.bfloat16)
    assert cache.prepared[1]().layers[0].wqkv.dtype == torch.bfloat16
    # both paths hold the same bfloat16 weights; each stored activation is rounded to bfloat16 (2**-8)
    assert (got - ref).abs().max() <= logits_bound(model, ids, store_u=U_BF16)
    packed = model.generate(ids, max_new_tokens=8, eos_token_id=None)
    model.cpu_weight_packing = False
    plain = model.generate(ids, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(packed, plain)


def test_dtype_conversion_releases_prepared_weights():
    """.half() / .to() after a generation: the old fused and packed weights are not kept alive, and a
    no-op .to() keeps the prepared weights."""
    import gc
    import weakref

    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=1)
    model.cpu_weight_packing = True
    prompt = torch.tensor([[1, 17, 42, 99]])
    model.generate(prompt, max_new_tokens=2)
    prepared = model._prepared
    model.float()  # nothing changes: nothing to rebuild
    assert model._prepared is prepared
    old = [weakref.ref(t) for t in (prepared[1].layers[0].wqkv, prepared[1].layers[0].wgu)]
    del prepared
    model.to(torch.bfloat16)
    gc.collect()
    assert all(r() is None for r in old)
    with torch.enable_grad():
        ref = model(prompt, use_cache=False).logits.detach()
    torch.testing.assert_close(model(prompt).logits, ref, atol=logits_bound(model, prompt, store_u=U_BF16), rtol=0)


@pytest.mark.parametrize("model_type,left_out", [("qwen2", "use_sliding_window"), ("qwen3", "use_sliding_window"),
                                                 ("mistral", "sliding_window")])
def test_sliding_window_fields_left_out_read_as_transformers_defaults(tmp_path, model_type, left_out):
    """A config.json without ``use_sliding_window`` (Qwen2: False, no window) or without
    ``sliding_window`` (Mistral: 4096) means what transformers' config classes default it to."""
    import json

    from genkit.models.llama import layer_windows

    torch.manual_seed(0)
    if model_type in ("qwen2", "qwen3"):
        make = transformers.Qwen2Config if model_type == "qwen2" else transformers.Qwen3Config
        cfg = make(**COMMON, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    else:
        cfg = transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=5)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop(left_out)
    config.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = genkit.load_model(tmp_path)
    n = hf.config.num_hidden_layers
    layer_types = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * n
    expected = [hf.config.sliding_window if kind == "sliding_attention" else None for kind in layer_types]
    assert layer_windows(ours.config) == ours.windows == expected
    ids = torch.randint(3, 160, (1, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=logits_bound(ours, ids), rtol=0)


def test_qwen3_config_without_head_dim_reads_qwen3_default(tmp_path):
    """A Qwen3 config.json without ``head_dim`` means Qwen3Config's 128, not ``hidden_size /
    num_attention_heads`` (16 here), as transformers reads it; the KV cache and the paged store follow."""
    import json

    from genkit.models.base import QWEN3_HEAD_DIM

    torch.manual_seed(0)
    _hf_model(CONFIGS["qwen3"]()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("head_dim") == QWEN3_HEAD_DIM
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = genkit.load_model(tmp_path)
    assert ours.model.layers[0].self_attn.head_dim == hf.config.head_dim == QWEN3_HEAD_DIM
    ids = torch.randint(3, 160, (1, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=logits_bound(ours, ids), rtol=0)
    assert ours.new_paged_store(block_size=4, num_blocks=2).keys[0].shape[-1] == QWEN3_HEAD_DIM


def test_model_built_in_inference_mode_generates():
    """Parameters made under torch.inference_mode have no version counter: such a model runs its
    modules (it used to fail with 'Inference tensors do not track version counter')."""
    from genkit.models.tiny import tiny_llama

    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    ref = tiny_llama(seed=1).generate(prompt, max_new_tokens=8, min_new_tokens=8)
    with torch.inference_mode():
        model = tiny_llama(seed=1)
    model.cpu_weight_packing = True
    assert torch.equal(model.generate(prompt, max_new_tokens=8, min_new_tokens=8), ref)
    with torch.inference_mode():
        assert torch.equal(model.generate(prompt, max_new_tokens=8, min_new_tokens=8), ref)


def test_kept_caches_do_not_keep_rebuilt_weights():
    """A cache kept after its generation (``return_dict_in_generate``: ``past_key_values``) must not keep
    the model alive, nor its prepared weights once they are rebuilt (a weight edit, e.g. a training
    step between generations): that held a model-sized copy per kept output."""
    import gc
    import weakref

    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=1)
    model.cpu_weight_packing = True
    prompt = torch.tensor([[1, 17, 42, 99]])
    out = model.generate(prompt, max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True)
    seq, kept = out.sequences, out.past_key_values  # kept holds seq[:, :-1]
    old = weakref.ref(model._prepared[1].layers[0].wgu)  # the fused (or packed) gate/up weight
    with torch.no_grad():  # two in-place edits that cancel out: the weights are rebuilt
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
        model.model.layers[0].mlp.up_proj.weight.div_(2.0)
    model.generate(prompt, max_new_tokens=3)
    gc.collect()
    assert old() is None  # the kept cache does not hold the old copies
    # the kept cache still works: its next step checks the weights again and uses the current ones
    step = model(seq[:, -1:], past_key_values=kept).logits[:, -1]
    torch.testing.assert_close(step, model(seq, use_cache=False).logits[:, -1], atol=logits_bound(model, seq), rtol=0)
    twin = weakref.ref(model)
    del model, out
    gc.collect()
    assert twin() is None  # nor the model


def test_submodule_replaced_after_a_generation_runs():
    """Wrapping or replacing a layer's submodule (activation steering without hooks) after a generation
    leaves the parameters as they were: the model must still notice and run its modules."""
    from genkit.models.tiny import tiny_llama

    class Silenced(torch.nn.Module):  # no parameters of its own
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.inner(x) * 0.0

    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    model, fresh = tiny_llama(seed=1), tiny_llama(seed=1)
    model.generate(prompt, max_new_tokens=4)
    for m in (model, fresh):
        m.model.layers[1].mlp = Silenced(m.model.layers[1].mlp)
    out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6)
    assert model.model.layers[1].mlp.calls == 6  # prompt + 5 decode steps
    assert torch.equal(out, fresh.generate(prompt, max_new_tokens=6, min_new_tokens=6))


def test_fused_optimizer_training_around_a_generation():
    """Train, generate (eval), train on: with ``fused=True`` optimizers, which step parameter, gradient
    and state as flat memory, the inference layout's strides scrambled the updates on the CPU."""
    from genkit.models.tiny import tiny_llama

    prompt = torch.tensor([[1, 17, 42, 99, 5, 23]])
    states = []
    for generate_between in (False, True):
        model = tiny_llama(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        for step in range(3):
            if step == 1 and generate_between:
                model.generate(prompt, max_new_tokens=3)
            with torch.enable_grad():
                model(prompt, use_cache=False).logits.logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        states.append(model.state_dict())
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, atol=1e-6, rtol=0, msg=name)
    # a generation after training lays the weights out again and matches the modules
    with torch.enable_grad():
        ref = model(prompt, use_cache=False).logits.detach()
    torch.testing.assert_close(model(prompt).logits, ref, atol=logits_bound(model, prompt), rtol=0)


def test_hook_registered_between_generations_on_one_cache_runs():
    """A chat that continues one cache across generate() calls: a forward hook registered between two
    turns (activation steering) must run on the next turn, though the cache was checked at its start."""
    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=1)
    cache = model.new_cache()
    first = model.generate(torch.tensor([[1, 17, 42, 99]]), past_key_values=cache, max_new_tokens=3,
                           min_new_tokens=3)
    calls = []

    def steer(module, args, out):
        calls.append(out.shape)
        return out + 0.5

    handle = model.model.layers[0].mlp.register_forward_hook(steer)
    try:
        turn = torch.cat([first, torch.tensor([[5, 6]])], 1)
        out = model.generate(turn, past_key_values=cache, max_new_tokens=4, min_new_tokens=4)
        assert len(calls) == 4  # the new prompt tokens + 3 decode steps
        # the same turn on a fresh cache (prefix unsteered, as in the kept cache): the modules all along
        fresh = model.new_cache()
        handle.remove()
        model(first[:, :-1], past_key_values=fresh)
        handle = model.model.layers[0].mlp.register_forward_hook(steer)
        assert torch.equal(out, model.generate(turn, past_key_values=fresh, max_new_tokens=4, min_new_tokens=4))
    finally:
        handle.remove()


def test_prompt_cache_with_several_sequences_per_prompt(tmp_path):
    """num_return_sequences > 1 on a batch of 2 with a prompt cache: the cache is expanded like the prompts."""
    import copy

    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=4)
    prefix = torch.tensor([[1, 17, 42], [1, 8, 9]])
    prompt = torch.cat([prefix, torch.tensor([[5, 23], [6, 7]])], 1)
    cache = model.new_cache()
    model(prefix, past_key_values=cache)
    kw = {"do_sample": True, "top_k": 1, "num_return_sequences": 3, "max_new_tokens": 6}
    out = model.generate(prompt, past_key_values=copy.deepcopy(cache), **kw)
    ref = model.generate(prompt, **kw)
    assert out.shape == (6, 11)
    assert torch.equal(out, ref)
