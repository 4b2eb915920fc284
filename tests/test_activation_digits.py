"""issue 32, llama-server's greedy tokens: ``activation_digits=1`` rounds a quantized model's
activations as llama.cpp does (one int8 digit per block of 32, a float16 scale; Q8_1's float16 block
sum for weights with a free minimum, Q8_0 for symmetric ones). The block kernel's one-digit products
against a float64 product of that rule; the one-call decode step and continuous batching's fused step
against the torch path with the same rounding; greedy tokens against a torch model whose linear layers
round their inputs by the rule; the two-digit default unchanged; the option's errors and CLI flag."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_block_kernel import _weight, one_call_and_torch_path
from test_quantized import IDS, MASK, _same_or_near_tie, write_quantized_gguf
from test_quantized import smollm2_gguf as smollm2_gguf  # noqa: F401  (the fixture)
from tolerance import gamma, hidden_bound, unit_roundoff

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.models import block_kernel
from genkit.models.gguf import read_gguf
from genkit.models.gguf_blocks import int4_parts_from_gguf
from genkit.models.paged import StepBatch, _paged_layers, paged_forward
from genkit.models.quant import Int4Linear, set_activation_digits

pytestmark = pytest.mark.skipif(not block_kernel.available(), reason="no C compiler for the block kernel")

U16 = unit_roundoff(torch.float16)  # 2**-11
# one int8 digit per block of 32 with a float16 scale: |dx16 * q - x| <= amax / 254 (the rounding) +
# 127 * |dx16 - dx| (the scale's float16 rounding, <= amax * U16); as a norm over the block, relative to
# the block's own norm (>= amax): sqrt(32) times that
U_ONE_DIGIT_NORM = math.sqrt(32) * (1 / 254 + U16)


def llama_cpp_round(x: torch.Tensor, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's activation rounding (ggml quantize_row_q8_1 / q8_0, x86 paths) of ``x`` (M, K) per
    block of 32, in float32 as it computes it: ``q = rint(x * (127 / amax))``, ``dx = fp16(amax / 127)``;
    the block sum ``s = fp16(amax / 127 * sum(q))`` (Q8_1), or ``dx * sum(q)`` for symmetric weights
    (Q8_0 has no sum: the weights' offset is in their signed codes). Returns ``(q, dx, s)``."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    d = (amax / np.float32(127)).astype(np.float32)
    dx = d.astype(np.float16).astype(np.float32)
    total = q.sum(-1).astype(np.float32)
    s = dx * total if symmetric else (d * total).astype(np.float16).astype(np.float32)
    return q, dx, s


def llama_cpp_product(x, codes, scale, minimum, symmetric):
    """``y`` of llama.cpp's rule in float64 -- per block ``d * dx * (u . q) + m * s`` -- and the sum of
    the terms' magnitudes (what the kernel's float32 scaling and summation are relative to)."""
    q, dx, s = llama_cpp_round(x, symmetric)
    rows, k = codes.shape
    group = k // scale.shape[1]
    u = torch.from_numpy(q).double()  # (M, nb, 32)
    c = codes.double().reshape(rows, k // group, group)
    parts = torch.stack([torch.einsum("mbj,nbj->mnb", u[..., h * group:(h + 1) * group],
                                      c[:, h::32 // group]) for h in range(32 // group)], -1)  # (M, N, nb, halves)
    qs = torch.from_numpy(q).double().reshape(*q.shape[:2], -1, group).sum(-1)  # sum(q) per group
    sg = torch.from_numpy(s).double()[..., None] if group == 32 else torch.from_numpy(dx).double()[..., None] * qs
    dxg = torch.from_numpy(dx).double()
    d, m = scale.double().reshape(rows, -1, 32 // group), minimum.double().reshape(rows, -1, 32 // group)
    scaled = d[None] * dxg[:, None, :, None] * parts
    offsets = m[None] * sg[:, None]
    return (scaled + offsets).sum((-1, -2)), (scaled.abs() + offsets.abs()).sum((-1, -2))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, False), (8, True), (6, True)])
def test_one_digit_products_follow_llama_cpps_rounding(bits, symmetric, m):
    """Every row tile (1-4 rows, the one-row decode kernel), 4-, 6- and 8-bit codes, both rules: the
    integer sums are exact, so the kernel differs from the float64 rule only by its float32 scaling
    (one rounding per block term) and summation: ``gamma_(2 terms per group + 2) * sum |term|``."""
    codes, scale, minimum = _weight(bits, 48, 256, seed=bits + m)
    if symmetric:
        minimum = -float(2 ** (bits - 1)) * scale
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.1, 10, 256)
    x[:, 32:64] = 0  # an all-zero block: scale 0
    act = block_kernel.act_mode(1, symmetric)
    got = block_kernel.matmul(x, block_kernel.pack(codes, scale, minimum, bits), bits, 48, act)
    want, terms = llama_cpp_product(x, codes, scale, minimum, symmetric)
    assert ((got.double() - want).abs() <= gamma(4 * 256 // 32 + 2) * terms).all()
    # and it is not the two-digit product: the rule is really in use
    two = block_kernel.matmul(x, block_kernel.pack(codes, scale, minimum, bits), bits, 48)
    assert not torch.equal(got, two)


def test_the_kernel_refuses_an_unknown_rounding():
    codes, scale, minimum = _weight(4, 16, 32)
    with pytest.raises(ConfigError, match=r"`act` must be one of 0-4 \(3 and 4 not for 6-bit weights\); got 7"):
        block_kernel.matmul(torch.ones(1, 32), block_kernel.pack(codes, scale, minimum, 4), 4, 16, 7)


@pytest.mark.parametrize(("qtype", "symmetric", "act"), [("Q4_0", True, 2), ("Q4_1", False, 1), ("Q8_0", True, 2),
                                                         ("Q6_K", True, 2), ("Q4_K", False, 1)])
def test_each_gguf_type_gets_llama_cpps_activation_type(tmp_path, qtype, symmetric, act):
    """Q4_0, Q8_0 (and Q6_K: llama.cpp's Q8_K is per 256 values, the closest per-32 rule is Q8_0's)
    have symmetric codes; Q4_1 and Q4_K a free minimum (Q8_1's block sum)."""
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, qtype, hidden=256, ffn=512)
    model = genkit.load_model(path, activation_digits=1)
    layer = model.model.layers[0].mlp.down_proj
    assert (layer.symmetric, layer.activation_digits, layer.act) == (symmetric, 1, act)
    assert model.activation_digits == 1


class LlamaCppRounded(torch.nn.Module):
    """A linear layer of float weights ``sum(parts)`` whose input is rounded by llama.cpp's rule
    (:func:`llama_cpp_round`), in float64: ``x_hat @ W.T`` plus, for Q8_1, its block sums'
    difference from ``sum(x_hat)`` times the weights' minimum."""

    def __init__(self, parts, symmetric):
        super().__init__()
        self.weight = torch.nn.Parameter(sum(p.dense().double() for p in parts), requires_grad=False)
        self.minimum = sum(p.minimum.double() for p in parts)
        self.symmetric = symmetric

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1]).float()
        q, dx, s = llama_cpp_round(flat, self.symmetric)
        q64, dx64 = torch.from_numpy(q).double(), torch.from_numpy(dx).double()
        x_hat = (q64 * dx64[..., None]).reshape(flat.shape)
        extra = torch.from_numpy(s).double() - dx64 * q64.sum(-1)  # zero for symmetric weights
        y = x_hat @ self.weight.t() + extra @ self.minimum.t()
        return y.float().reshape(*x.shape[:-1], -1)


def llama_cpp_reference(path, qtype):
    """The GGUF's float model with every quantized linear layer a :class:`LlamaCppRounded`."""
    contents = read_gguf(path, keep_quantized=frozenset({qtype}))
    model = genkit.load_model(path, dequantize=True)
    for name, (type_name, data, shape) in contents.quantized.items():
        module = name.rsplit(".", 1)[0]
        parent, _, child = module.rpartition(".")
        rounded = LlamaCppRounded(int4_parts_from_gguf(type_name, data, shape), qtype in ("Q4_0", "Q8_0"))
        setattr(model.get_submodule(parent) if parent else model, child, rounded)
    return model


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_greedy_tokens_are_those_of_a_model_rounding_like_llama_cpp(tmp_path, qtype):
    """Prompt and one-call decode steps (one row), padded batches (the torch path): the one-digit
    model's greedy tokens equal the reference's, or part at a near-tie of the reference's logits."""
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, qtype, embed_qtype="F32", tied=False)
    q = genkit.load_model(path, activation_digits=1)
    ref = llama_cpp_reference(path, qtype)
    kw = {"max_new_tokens": 16, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        for ids, mask in ((IDS[:1], MASK[:1]), (IDS, MASK)):
            _same_or_near_tie(ref, q.generate(ids, attention_mask=mask, **kw),
                              ref.generate(ids, attention_mask=mask, **kw), mask, bound=0.05)


@pytest.fixture(scope="module")
def one_digit(tmp_path_factory):
    path = tmp_path_factory.mktemp("one") / "q.gguf"
    write_quantized_gguf(path, "Q4_0")
    model = genkit.load_model(path, activation_digits=1)
    with torch.no_grad():
        model(IDS[:1])  # prepares the inference weights
    return model


def test_a_one_call_decode_step_equals_the_torch_path(one_digit):
    prepared = one_digit._prepared[1]
    decoder = prepared.decoder
    assert all(w.act == block_kernel.ACT_Q8_0 for w in (prepared.layers[0].wqkv, prepared.layers[0].wd))
    ids = IDS[:, 1:]
    pos = ids.shape[1]
    x = torch.randn(2, 1, one_digit.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = one_digit.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
    with torch.no_grad():
        ours_cache = one_digit(ids, use_cache=True).past_key_values
        torch_cache = one_digit(ids, use_cache=True).past_key_values
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, ours_cache, torch_cache, None)
    # the same one-digit products; another summation order can move an activation across a rounding
    # boundary of its digit (by amax / 127 of its block)
    assert ours is not None
    n = len(prepared.layers)
    torch.testing.assert_close(ours, want, rtol=0, atol=hidden_bound(one_digit.config, pos + 1, n, want,
                                                                     linear_u=U_ONE_DIGIT_NORM))
    kw = {"max_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}
    fast = one_digit.generate(IDS[:1], **kw)
    prepared.decoder = None
    try:
        assert torch.equal(fast, one_digit.generate(IDS[:1], **kw))
    finally:
        prepared.decoder = decoder


def test_continuous_batchings_fused_step_equals_the_torch_step(one_digit):
    prompts = [[5, 9, 11], [7, 3, 3, 3, 8, 1, 2], [40]]
    stores = [one_digit.new_paged_store(block_size=4, num_blocks=64) for _ in range(2)]
    blocks = [[0], [1, 2, 3], [4]]
    spans = [(0, 3), (3, 7), (10, 1)]
    prefill = StepBatch(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(len(p)) for p in prompts]), spans,
                        [0, 0, 0], blocks, [True] * 3)
    cached = [len(p) for p in prompts]
    step = StepBatch(torch.tensor([17, 18, 19]), torch.tensor(cached), [(0, 1), (1, 1), (2, 1)], cached, blocks,
                     [True] * 3)
    with torch.inference_mode():
        for store in stores:
            paged_forward(one_digit, store, prefill)
        prepared = stores[0].prepared
        x = one_digit.model.embed_tokens(step.ids)
        cos_t, sin_t = one_digit._rope_table(max(cached) + 1, x.dtype)
        cos, sin = cos_t[step.positions], sin_t[step.positions]
        fused = prepared.decoder.paged(x, cos, sin, step.positions, stores[0], blocks)
        ref = _paged_layers(prepared, stores[1], step, x[None], cos, sin, one_digit.dtype)[0]
    assert fused is not None
    atol = hidden_bound(one_digit.config, max(cached) + 1, len(prepared.layers), ref, linear_u=U_ONE_DIGIT_NORM)
    torch.testing.assert_close(fused, ref, rtol=0, atol=atol)


def test_two_digits_stay_the_default_and_switching_back_restores_them(tmp_path):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    model = genkit.load_model(path)
    assert model.model.layers[0].self_attn.q_proj.act == block_kernel.ACT_TWO
    with torch.no_grad():
        two = model(IDS, attention_mask=MASK).logits
        one = set_activation_digits(model, 1)(IDS, attention_mask=MASK).logits
        again = set_activation_digits(model, 2)(IDS, attention_mask=MASK).logits
    assert torch.equal(two, again)
    assert not torch.equal(one, two)
    with torch.no_grad():
        assert torch.equal(one, genkit.load_model(path, activation_digits=1)(IDS, attention_mask=MASK).logits)


def test_quantize_takes_the_option(tiny_model):
    model = genkit.quantize(tiny_model, "int4", activation_digits=1)
    layer = model.model.layers[0].self_attn.q_proj
    assert (layer.activation_digits, layer.symmetric, layer.act) == (1, True, block_kernel.ACT_Q8_0)


@pytest.mark.parametrize("bad", [0, 3, "1", True, 1.0])
def test_bad_values_are_refused_before_loading(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"`activation_digits` must be one of 1, 2; got "):
        genkit.load_model(tmp_path / "absent.gguf", activation_digits=bad)


def test_a_float_model_or_torchs_int4_kernel_is_refused(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"`activation_digits` applies to quantized models .* has no quantized layers"):
        set_activation_digits(tiny_model, 1)
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    with pytest.raises(ConfigError, match=r"`activation_digits` applies to quantized models"):
        genkit.load_model(path, dequantize=True, activation_digits=2)
    from genkit.models.quant import kernel_available

    if not kernel_available():
        return
    layer = Int4Linear(64, 16, _parts(), kernel="torch")
    with pytest.raises(NotSupportedError, match=r"`activation_digits`=1 needs the block kernel"):
        set_activation_digits(torch.nn.Sequential(layer), 1)
    set_activation_digits(torch.nn.Sequential(layer), 2)  # what torch's kernel does anyway


def _parts():
    from genkit.models.quant import Int4Part

    codes, scale, minimum = _weight(4, 16, 64)
    return [Int4Part(codes, scale, minimum)]


def test_the_cli_flag_reaches_the_model(smollm2_gguf, capsys):
    from genkit.cli import main

    tok = genkit.load_tokenizer(smollm2_gguf)
    models = {digits: genkit.load_model(smollm2_gguf, activation_digits=digits) for digits in (1, 2)}
    # The two roundings part on some prompt within 30 tokens, but which prompt depends on the CPU's
    # kernel (AVX2, AVX-512 VNNI): take the first of these where they do, so the CLI run can tell.
    for prompt in ("The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
                   "Once upon a time, in a small village,", "def fibonacci(n):"):
        ids = tok(prompt, return_tensors="pt").input_ids
        texts = {digits: tok.decode(model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)[
            0, ids.shape[1]:], skip_special_tokens=True) for digits, model in models.items()}
        if texts[1] != texts[2]:
            break
    assert texts[1] != texts[2]  # else the test could not tell
    assert main(["generate", prompt, "--model", smollm2_gguf, "--max-new-tokens", "30", "--set", "eos_token_id=null",
                 "--activation-digits", "1"]) == 0
    assert capsys.readouterr().out.strip() == texts[1].strip()
    assert main(["generate", prompt, "--model", smollm2_gguf, "--activation-digits", "3"]) == 2
    assert "--activation-digits must be 1 or 2; got 3" in capsys.readouterr().err
    assert main(["batch", "in.jsonl", "out.jsonl", "--engine", "ray", "--activation-digits", "1"]) == 2
    assert "--activation-digits applies to --engine local" in capsys.readouterr().err
