"""numerics="llama.cpp": each float rule of llama.cpp's CPU backend (its AVX2 and AVX-512 builds) that
the block kernel follows, against an exact reference of the rule (rational arithmetic rounded once to
float32 where ggml fuses a multiply-add, IEEE float32 elsewhere), and the demo model's greedy tokens
and logits against those llama.cpp gave (recorded: llama.cpp is no dependency)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from test_activation_digits import llama_cpp_round
from test_block_kernel import _run, _weight
from test_quantized import IDS, MASK, write_quantized_gguf
from test_quantized import smollm2_gguf as smollm2_gguf  # noqa: F401  (the fixture)

import genkit
from genkit.errors import ConfigError, NotSupportedError
from genkit.models import block_kernel
from genkit.models import numerics as numerics_
from genkit.models.quant import set_numerics

pytestmark = pytest.mark.skipif(not block_kernel.available(), reason="no C compiler for the block kernel")
F32 = np.float32


def _round_binary(value: Fraction, mantissa: int, min_exponent: int) -> float:
    """``|value|`` rounded once to the nearest binary float with ``mantissa`` stored bits and
    exponents from ``min_exponent`` (subnormals below it), ties to even; no overflow handling."""
    if value == 0:
        return 0.0
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += 1 if a >= Fraction(2) ** (e + 1) else (-1 if a < Fraction(2) ** e else 0)
    scale = Fraction(2) ** (mantissa - max(e, min_exponent))
    n, rem = divmod(a * scale, 1)
    n += rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1)
    return float(Fraction(n) / scale)


def round_f32(value: Fraction) -> float:
    """``value`` rounded once to the nearest float32 (ties to even; normal range)."""
    return math.copysign(_round_binary(value, 23, -126), value)


def fma32(a: float, b: float, c: float) -> float:
    """float32 fused multiply-add: ``a * b + c`` exactly, rounded once."""
    return round_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def llama_cpp_dot_order(x, codes, scale, minimum, bits, symmetric):
    """ggml_vec_dot_q4_1_q8_1 / q4_0_q8_0 / q8_0_q8_0 (AVX2) of every activation row and weight row:
    per block, 8 lanes of 4 consecutive integer products, ``acc = fma(d * dx, lane, acc)``; Q4_1's
    ``summs = fma(m, s, summs)``; ``((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)) + summs`` in float32."""
    q, dx, s = llama_cpp_round(x, symmetric)
    signed = codes.numpy().astype(np.int64) - (2 ** (bits - 1) if symmetric else 0)  # Q4_0/Q8_0's signed codes
    rows, nb = scale.shape
    out = np.zeros((x.shape[0], rows), dtype=F32)
    for m in range(x.shape[0]):
        for n in range(rows):
            acc, summs = [0.0] * 8, 0.0
            for b in range(nb):
                d0d1 = F32(scale[n, b]) * F32(dx[m, b])
                for lane in range(8):
                    cols = slice(32 * b + 4 * lane, 32 * b + 4 * lane + 4)
                    isum = int((signed[n, cols] * q[m, b, 4 * lane:4 * lane + 4].astype(np.int64)).sum())
                    acc[lane] = fma32(d0d1, isum, acc[lane])
                if not symmetric:
                    summs = fma32(minimum[n, b], s[m, b], summs)
            h = [F32(acc[i + 4]) + F32(acc[i]) for i in range(4)]
            out[m, n] = ((h[0] + h[2]) + (h[1] + h[3])) + F32(summs)
    return out


@pytest.mark.parametrize(("bits", "symmetric"), [(4, False), (4, True), (8, True)])
def test_products_are_summed_in_llama_cpps_order(bits, symmetric):
    """Q4_1, Q4_0 and Q8_0 weights: the llama.cpp-order product equals the rule bit for bit, for one
    row (decode) and several (the rows are independent, as in llama.cpp)."""
    codes, scale, minimum = _weight(bits, 16, 128, seed=bits)
    if symmetric:
        minimum = -float(2 ** (bits - 1)) * scale
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.1, 10, 128)
    x[:, 32:64] = 0  # an all-zero block
    act = block_kernel.llama_order(block_kernel.act_mode(1, symmetric))
    got = block_kernel.matmul(x, block_kernel.pack(codes, scale, minimum, bits), bits, 16, act)
    want = llama_cpp_dot_order(x, codes, scale.numpy(), minimum.numpy(), bits, symmetric)
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(got[:1].numpy(), block_kernel.matmul(x[:1], block_kernel.pack(codes, scale, minimum, bits),
                                                               bits, 16, act).numpy())


LLAMA_PRODUCTS = """
import json, torch
from test_block_kernel import _weight
from genkit.models import block_kernel as bk
out = {}
for bits, symmetric in ((4, False), (4, True), (8, True)):
    codes, scale, minimum = _weight(bits, 48, 256, seed=7 + bits)
    if symmetric:
        minimum = -float(2 ** (bits - 1)) * scale
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.01, 30, 256)
    act = bk.llama_order(bk.act_mode(1, symmetric))
    y = bk.matmul(x, bk.pack(codes, scale, minimum, bits), bits, 48, act)
    out[f"{bits}{symmetric}"] = [bk.simd(), y.view(torch.int32).tolist()]
print(json.dumps(out))
"""


def test_the_vector_and_portable_llama_order_products_are_bit_identical(tmp_path):
    """The vector build sums 8 rows per register (AVX2) or a panel's 16 with one vpdpbusd per lane
    (AVX-512 VNNI); the portable build one row at a time: the same float operations in the same
    order, so the same bits (Q4_1, Q4_0 and Q8_0 weights, 5 rows, 3 panels)."""
    env = {"GENKIT_HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH", "")])}
    native = json.loads(_run(LLAMA_PRODUCTS, env))
    portable = json.loads(_run(LLAMA_PRODUCTS, {**env, "GENKIT_BLOCK_KERNEL": "portable"}))
    for key, (simd, bits) in portable.items():
        assert simd == "" and bits == native[key][1], key


LLAMA_STEPS = """
import json, sys, torch
import genkit
from test_quantized import write_quantized_gguf
from genkit.models import block_kernel as bk
from genkit.models.numerics import LLAMA_AVX2, LLAMA_AVX512
torch.set_num_threads(2)
out = {"simd": bk.simd()}
g = torch.Generator().manual_seed(3)
x = torch.cat([torch.randn(60, generator=g) * 8, torch.tensor([-95.0, -150.0, -200.0, 90.0, 0.0])])
up = torch.rand(65, generator=g) + 0.5
act = torch.empty(65)
for order in (LLAMA_AVX2, LLAMA_AVX512):
    bk.library().gk_swiglu_llama(x.data_ptr(), up.data_ptr(), act.data_ptr(), 65, order)
    out[f"swiglu{order}"] = act.view(torch.int32).tolist()
for hidden in (256, 160, 512):  # head_dim 64 (SmolLM2's), 40 (a tail after the steps of 32) and 128
    path = f"{sys.argv[1]}/q{hidden}.gguf"
    write_quantized_gguf(path, "Q4_1", hidden=hidden, ffn=2 * hidden, seed=hidden)
    ids = torch.randint(3, 250, (1, 9), generator=g)
    for numerics in ("llama.cpp-avx2", "llama.cpp-avx512", "llama.cpp-avx512-fp16"):
        model = genkit.load_model(path, numerics=numerics)
        for rows in (1, 3):  # one sequence; three rows at one position
            with torch.inference_mode():
                res = model.generate(ids.repeat(rows, 1), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                     output_scores=True, return_dict_in_generate=True)
            out[f"{numerics} {hidden}x{rows}"] = [s.view(torch.int32).tolist() for s in res.scores]
print(json.dumps(out))
"""


def test_the_vector_and_portable_llama_decode_steps_are_bit_identical(tmp_path):
    """The decode step's attention (8- or 16-lane dot products and float16 V accumulator, query heads
    sharing a pass over the cache) and SwiGLU (ggml_v_expf in vectors) of the vector build against the
    portable build's scalar loops, in each of ggml's float orders (AVX2, AVX-512, AVX-512 with float16
    arithmetic: AVX-512 FP16's vfmadd where the CPU has it, against fma_f16's exact integers): the same
    logits bit for bit, step after step (a prompt, then 24 tokens; one row and three), head_dim 64, 40
    and 128, and SwiGLU on values that take exp's overflow branches. The orders' logits differ where
    they should: float16 arithmetic only for heads of 128 or more."""
    env = {"GENKIT_HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                      os.environ.get("PYTHONPATH", "")])}
    native = json.loads(_run(LLAMA_STEPS, env, str(tmp_path)))
    portable = json.loads(_run(LLAMA_STEPS, {**env, "GENKIT_BLOCK_KERNEL": "portable"}, str(tmp_path)))
    assert native.pop("simd") != "" and portable.pop("simd") == ""
    assert native.keys() == portable.keys() and len(native["llama.cpp-avx512 256x3"]) == 24
    for key in native:
        assert native[key] == portable[key], key
    assert native["llama.cpp-avx2 256x1"] != native["llama.cpp-avx512 256x1"]
    assert native["llama.cpp-avx512 256x1"] == native["llama.cpp-avx512-fp16 256x1"]
    assert native["llama.cpp-avx512 512x1"] != native["llama.cpp-avx512-fp16 512x1"]


def test_llama_order_needs_one_digit_and_refuses_6_bit_weights():
    with pytest.raises(ConfigError, match="one activation digit"):
        block_kernel.llama_order(block_kernel.ACT_TWO)
    codes, scale, minimum = _weight(6, 16, 32)
    with pytest.raises(ConfigError, match=r"not for 6-bit weights\); got 4 for 6-bit"):
        block_kernel.matmul(torch.ones(1, 32), block_kernel.pack(codes, scale, minimum, 6), 6, 16,
                            block_kernel.ACT_LLAMA_Q8_0)


def _libm():
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("cosf", "sinf", "expf"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_float, [ctypes.c_float]
    lib.powf.restype, lib.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return lib


def test_rope_tables_are_llama_cpps_angles():
    """ggml_rope_cache_init: ``theta_scale = powf(base, -2/d)``, the angle of pair i is the position
    multiplied by it i times in float32, then cosf/sinf (genkit's halves layout, signed sin)."""
    libm = _libm()
    base, d, n = 100000.0, 64, 40
    cos, sin = block_kernel.rope_table_llama(base, d, n)
    theta_scale = F32(libm.powf(base, F32(-2.0) / F32(d)))
    for p in range(n):
        theta = F32(p)
        for i in range(d // 2):
            c, s = F32(libm.cosf(theta)), F32(libm.sinf(theta))
            assert cos[p, i] == cos[p, i + d // 2] == c and sin[p, i + d // 2] == s and sin[p, i] == -s
            theta = F32(theta * theta_scale)
    # not genkit's own table (float32 position times inverse frequency): the rule is really in use
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    assert not torch.equal(cos[:, :d // 2], (torch.arange(n).float()[:, None] * inv[None]).cos())


def test_rms_norm_is_ggmls():
    """ggml_compute_forward_rms_norm: x*x in float32 summed in double (in order), the mean rounded to
    float32, ``scale = 1 / sqrtf(mean + eps)``, then ``x * scale * w``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g)
    x[:, 7] = 300.0  # SmolLM2-like outlier
    w = torch.rand(576, generator=g) + 0.5
    got = block_kernel.rms_norm_llama(x, w, 1e-5).numpy()
    for r in range(3):
        xs = x[r].numpy()
        total = 0.0
        for v in xs:
            total += float(F32(v * v))
        mean = F32(total / 576)
        scale = F32(1.0) / np.sqrt(mean + F32(1e-5))
        assert np.array_equal(got[r], (xs * scale) * w.numpy())


def expf_ggml(x: float) -> float:
    """ggml_v_expf (AVX2), one lane, with each fused multiply-add rounded once."""
    def bits(f):
        return int(np.array(f, dtype=F32).view(np.uint32))

    def flt(u):
        return float(np.array(u & 0xFFFFFFFF, dtype=np.uint32).view(F32))

    r = float.fromhex("0x1.8p23")
    z = fma32(x, float.fromhex("0x1.715476p+0"), r)
    n = float(F32(z) - F32(r))
    b = fma32(-n, float.fromhex("0x1.7f7d1cp-20"), fma32(-n, float.fromhex("0x1.62e4p-1"), x))
    e = (bits(z) << 23) & 0xFFFFFFFF
    k = flt(e + bits(1.0))
    u = float(F32(b) * F32(b))
    j = fma32(fma32(fma32(float.fromhex("0x1.0e4020p-7"), b, float.fromhex("0x1.573e2ep-5")), u,
                    fma32(float.fromhex("0x1.555e66p-3"), b, float.fromhex("0x1.fffdb6p-2"))),
              u, float(F32(float.fromhex("0x1.ffffecp-1")) * F32(b)))
    if not abs(n) > 126:
        return fma32(j, k, k)
    g = 0x82000000 if n <= 0 else 0
    s1, s2 = flt(g + 0x7F000000), flt(e - g)
    with np.errstate(over="ignore"):  # the overflow branches give inf as ggml's do
        return float(F32(s1) * F32(s1)) if abs(n) > 192 else float(F32(fma32(s2, j, s2)) * F32(s1))


def round_f16(value: Fraction) -> float:
    """``value`` rounded once to the nearest float16 (ties to even; subnormals; inf from 65520 on)."""
    r = _round_binary(value, 10, -14)
    return math.copysign(math.inf if r > 65504 else r, value)


def test_float16_fma_rounds_once():
    """AVX-512 FP16's vfmadd, as numerics="llama.cpp-avx512-fp16" computes it where the CPU has none
    (fma_f16): ``x v + y`` of float16 values exactly, rounded once to float16: random values, products
    exactly on a rounding midpoint (ties to even, and a tiny addend that decides where rounding to
    float32 first would tie), subnormal results and overflow."""
    g = torch.Generator().manual_seed(5)
    cases = torch.stack([torch.randn(400, generator=g) * 4, torch.rand(400, generator=g),
                         torch.randn(400, generator=g) * 50], dim=1)
    tiny = 2.0 ** -24  # the smallest float16
    crafted = torch.tensor([
        [1.5, 683 / 1024, 0.0], [1.5, 683 / 1024, tiny], [1.5, 683 / 1024, -tiny],  # x v = 1 + 2^-11, a midpoint
        [1.75, 293 / 512, 0.0],  # x v = 1 + 3 * 2^-11: the tie goes up, to the even 1 + 2^-9
        [2.0 ** -14, 2.0 ** -10, 0.0], [48 * tiny, 2.0 ** -5, 0.0], [48 * tiny, 2.0 ** -5, tiny],  # subnormals
        [60000.0, 1.0, 6000.0], [-60000.0, 1.0, -6000.0], [2.0, 0.5, -1.0]])
    x, v, y = (c.half().float().contiguous() for c in torch.cat([cases, crafted]).unbind(1))
    assert torch.equal(torch.cat([cases, crafted])[400:], torch.stack([x, v, y], 1)[400:])  # all float16 values
    out = torch.empty_like(x)
    block_kernel.library().gk_fma_f16(x.data_ptr(), v.data_ptr(), y.data_ptr(), out.data_ptr(), x.shape[0])
    for i in range(x.shape[0]):
        want = round_f16(Fraction(x[i].item()) * Fraction(v[i].item()) + Fraction(y[i].item()))
        assert out[i].item() == want, (i, x[i].item(), v[i].item(), y[i].item())
    assert out[400:404].tolist() == [1.0, 1 + 2.0 ** -10, 1.0, 1 + 2.0 ** -9]
    assert out[405].item() == 2 * tiny and out[406].item() == 2 * tiny  # 1.5 and 2.5 of the smallest: to even
    assert out[407].item() == math.inf and out[408].item() == -math.inf


def expf_ggml512(x: float) -> float:
    """ggml_v_expf (AVX-512), one lane: the polynomial ends with ``fma(c0, b, 1)``, then ``j * 2**n``
    rounded once (vscalefps); inf or 0 beyond ``|n| > 192``."""
    r = float.fromhex("0x1.8p23")
    n = float(F32(fma32(x, float.fromhex("0x1.715476p+0"), r)) - F32(r))
    b = fma32(-n, float.fromhex("0x1.7f7d1cp-20"), fma32(-n, float.fromhex("0x1.62e4p-1"), x))
    u = float(F32(b) * F32(b))
    j = fma32(fma32(fma32(float.fromhex("0x1.0e4020p-7"), b, float.fromhex("0x1.573e2ep-5")), u,
                    fma32(float.fromhex("0x1.555e66p-3"), b, float.fromhex("0x1.fffdb6p-2"))),
              u, fma32(float.fromhex("0x1.ffffecp-1"), b, 1.0))
    if abs(n) > 192:
        return 0.0 if n <= 0 else math.inf
    scaled = Fraction(j) * Fraction(2) ** int(n)
    return math.inf if scaled >= Fraction(2) ** 128 else round_f32(scaled)


@pytest.mark.parametrize(("order", "rule", "step"), [(numerics_.LLAMA_AVX2, expf_ggml, 8),
                                                     (numerics_.LLAMA_AVX512, expf_ggml512, 16)])
def test_swiglu_is_ggmls(order, rule, step):
    """ggml_vec_swiglu_f32 of its AVX2 and AVX-512 builds: ``x / (1 + ggml_v_expf(-x)) * u`` in steps
    of 8 or 16 (each build's ggml_v_expf), libm's expf for the rest; equal to that rule bit for bit
    (exp's overflow and underflow branches included), and within 4 float32 ulps of silu(x) * u where
    exp(-x) is finite (exp within 1.95 ulp, then three roundings)."""
    libm = _libm()
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(40, generator=g) * 8, torch.tensor([-95.0, -150.0, -200.0, 90.0, 0.0, -1e-3])])
    x = torch.cat([x, torch.randn(3, generator=g)])  # 49 values: 48 by the vector rule, 1 by the scalar one
    up = torch.rand(x.shape[0], generator=g) + 0.5
    out = torch.empty_like(x)
    block_kernel.library().gk_swiglu_llama(x.data_ptr(), up.data_ptr(), out.data_ptr(), x.shape[0], order)
    assert 48 % step == 0
    for i, (xi, ui) in enumerate(zip(x.numpy(), up.numpy())):
        with np.errstate(over="ignore"):
            e = F32(rule(float(F32(0) - xi))) if i < 48 else F32(libm.expf(-xi))
        assert out[i].item() == float(xi / (F32(1) + e) * ui), (i, xi)
        if abs(xi) < 80:  # beyond, exp(-x) overflows float32 and silu is 0 or x
            exact = float(xi) / (1 + math.exp(-float(xi))) * float(ui)
            assert abs(out[i].item() - exact) <= 4 * 2.0**-23 * abs(exact)


# The demo model's greedy tokens (first 32) from llama.cpp (llama_cpp_python 0.3.36's vendored
# llama.cpp; llama-server's defaults: flash attention auto -> on, float16 K/V cache; 2 threads) on
# bench/bench_serve.py's prompts, and the first step's three best logits (float32, hex), from its
# AVX2 build (an AMD EPYC, and the same bits from an AVX2-only build on an Intel Xeon) and its native
# build on an Intel Xeon with AVX-512 and AVX-512 FP16 (AMX off: its AMX kernel crashes there; the same
# bits with -mno-avx512fp16, as heads of 64 take no float16 arithmetic).
LLAMA_CPP = {
    "llama.cpp-avx2": {
        "The capital of France is": (
            [7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 34, 33, 2215, 701, 30, 198, 198,
             504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33],
            {7042: "0x1.1bd246p+4", 260: "0x1.e77634p+3", 4528: "0x1.b67d58p+3"}),
        "Once upon a time, in a small village by the sea,": (
            [665, 436, 253, 9357, 1573, 4166, 3365, 3906, 4075, 30, 2306, 436, 253, 10632, 11239, 259, 284, 761, 253,
             1767, 10274, 816, 1041, 856, 11239, 260, 1035, 6913, 282, 260, 905, 30],
            {665: "0x1.a12692p+3", 253: "0x1.7c555ap+3", 260: "0x1.5a2b5ap+3"}),
        "def fibonacci(n):": (
            [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 2822, 24, 38572, 46477, 24, 94, 731, 216,
             33, 25, 1232, 216, 33, 28, 304, 25, 198, 198, 19],
            {472: "0x1.ec6c42p+4", 198: "0x1.aab46p+4", 3805: "0x1.9f42p+4"}),
        "The three most important inventions of the twentieth century are": (
            [260, 20440, 28, 260, 13698, 28, 284, 260, 8552, 30, 198, 198, 504, 20440, 436, 11396, 411, 10472, 41106,
             30, 909, 3658, 253, 8329, 338, 5375, 253, 8329, 105, 8329, 30, 909],
            {260: "0x1.f041f4p+3", 42: "0x1.b39026p+3", 27435: "0x1.aea896p+3"}),
    },
    "llama.cpp-avx512": {
        "The capital of France is": (
            [7042, 30, 198, 198, 504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33, 33, 2215, 701, 30, 198, 198,
             504, 1797, 1918, 553, 253, 2155, 282, 4723, 216, 35, 33],
            {7042: "0x1.191b8p+4", 260: "0x1.e10d76p+3", 4528: "0x1.aed88cp+3"}),
        "Once upon a time, in a small village by the sea,": (
            [665, 436, 253, 9357, 1573, 267, 19341, 3365, 17644, 254, 30, 909, 4161, 281, 253, 11637, 10000, 411, 253,
             3953, 4480, 4412, 351, 511, 11695, 282, 9077, 6734, 30, 198, 198, 1082],
            {665: "0x1.997508p+3", 253: "0x1.77cec6p+3", 260: "0x1.54d8b2p+3"}),
        "def fibonacci(n):": (
            [472, 585, 304, 1758, 216, 32, 42, 448, 1003, 216, 33, 472, 1003, 304, 1672, 3987, 46477, 24, 94, 731, 216,
             33, 25, 198, 198, 3272, 24, 38572, 46477, 24, 33, 32],
            {472: "0x1.e7e3p+4", 198: "0x1.a8e1b6p+4", 3805: "0x1.9921d2p+4"}),
        "The three most important inventions of the twentieth century are": (
            [260, 20440, 28, 260, 13698, 28, 284, 260, 8552, 30, 198, 198, 504, 20440, 436, 11396, 411, 10472, 22074,
             12585, 281, 216, 33, 40, 40, 37, 30, 378, 13698, 436, 11396, 411],
            {260: "0x1.f0b8b8p+3", 42: "0x1.adee34p+3", 27435: "0x1.a9c8eap+3"}),
    },
}
LLAMA_CPP["llama.cpp-avx512-fp16"] = LLAMA_CPP["llama.cpp-avx512"]  # heads of 64: the same bits (above)
NATIVE = LLAMA_CPP[numerics_.native_llama_numerics()]  # what numerics="llama.cpp" follows on this CPU


# Heads of 128 (ggml's float16 steps of 128 under AVX-512 FP16): the 12 greedy steps (token: its logit)
# of write_quantized_gguf(Q4_1, hidden=512, ffn=1024, seed=512) after the ids HEAD_128_IDS, from the
# same llama.cpp builds on the Xeon (native, with AVX-512 FP16; with -mno-avx512fp16; AVX2 only) and
# llama-server's defaults, 2 threads.
HEAD_128_IDS = [5, 17, 99, 3, 42, 7, 8, 150, 23]
HEAD_128 = {
    "llama.cpp-avx2": "55:0x1.423072p+2 77:0x1.8339cp+2 225:0x1.439d96p+2 220:0x1.12dafcp+2 81:0x1.2afd14p+2 "
                      "195:0x1.4108f2p+2 158:0x1.90ea1cp+2 178:0x1.319bd2p+2 114:0x1.56f0acp+2 68:0x1.4b4c74p+2 "
                      "151:0x1.52a1p+2 48:0x1.7d8fdp+2",
    "llama.cpp-avx512": "55:0x1.423072p+2 77:0x1.8339cp+2 225:0x1.439d96p+2 220:0x1.0e96a8p+2 81:0x1.2954bp+2 "
                        "195:0x1.40c7c6p+2 158:0x1.90292cp+2 178:0x1.2e0576p+2 114:0x1.57b26cp+2 68:0x1.4abc4p+2 "
                        "151:0x1.513df4p+2 48:0x1.7d4ad4p+2",
    "llama.cpp-avx512-fp16": "55:0x1.3f1cep+2 77:0x1.852e78p+2 225:0x1.450e24p+2 220:0x1.11cd64p+2 81:0x1.2927acp+2 "
                             "195:0x1.41f20ep+2 158:0x1.90c554p+2 178:0x1.2d2238p+2 114:0x1.52c2fp+2 "
                             "68:0x1.4cff94p+2 151:0x1.54e0ecp+2 48:0x1.7d393ep+2",
}


@pytest.mark.parametrize("numerics", sorted(HEAD_128))
def test_heads_of_128_follow_each_builds_value_sums(tmp_path, numerics):
    """A model with heads of 128: llama.cpp's AVX-512 FP16 build sums the attention's values in float16
    arithmetic, its other builds in float32 fma rounded to float16; each order gives its build's 12
    greedy tokens and their logits to the last bit (on any CPU: the float16 steps run on AVX-512 FP16
    where there is one, else as exact integers)."""
    path = tmp_path / "h128.gguf"
    write_quantized_gguf(path, "Q4_1", hidden=512, ffn=1024, seed=512)
    model = genkit.load_model(path, numerics=numerics)
    with torch.inference_mode():
        out = model.generate(torch.tensor([HEAD_128_IDS]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    got = [(t, float(sc[0, t])) for t, sc in zip(out.sequences[0, len(HEAD_128_IDS):].tolist(), out.scores)]
    want = [(int(t), float.fromhex(v)) for t, v in (step.split(":") for step in HEAD_128[numerics].split())]
    assert got == want


@pytest.fixture(scope="module")
def smollm2_llama(smollm2_gguf):  # noqa: F811
    return genkit.load_model(smollm2_gguf, numerics="llama.cpp"), genkit.load_tokenizer(smollm2_gguf)


@pytest.mark.parametrize("numerics", sorted(LLAMA_CPP))
def test_smollm2_gives_llama_cpps_greedy_tokens_and_logits(smollm2_llama, numerics):
    """Every rule together on the Q4_1 demo file, in each build's float order (whatever this CPU has):
    llama.cpp's tokens, and its logits to the last bit (the two-digit default parts from llama.cpp
    within 5-19 tokens on these prompts, and the two builds part from each other within 5-18)."""
    model, tok = smollm2_llama
    set_numerics(model, numerics)
    try:
        for prompt, (tokens, logits) in LLAMA_CPP[numerics].items():
            ids = torch.tensor([tok.encode(prompt)])
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=len(tokens), do_sample=False, eos_token_id=None,
                                     output_scores=True, return_dict_in_generate=True)
            assert out.sequences[0, ids.shape[1]:].tolist() == tokens, prompt
            assert {t: float(out.scores[0][0, t]).hex() for t in logits} == {t: float.fromhex(v).hex()
                                                                              for t, v in logits.items()}
    finally:
        set_numerics(model, "llama.cpp")


def test_llama_cpp_means_the_build_for_this_cpu(smollm2_llama):
    """``numerics="llama.cpp"`` resolves to the float order of llama.cpp built for this CPU (AVX-512
    code where the CPU has AVX-512 F, with float16 arithmetic where it has AVX-512 FP16), and says so
    in ``model.numerics``."""
    model, _ = smollm2_llama
    flags = block_kernel.cpu_flags()
    assert model.numerics == ("llama.cpp-avx2" if "avx512f" not in flags else
                              "llama.cpp-avx512-fp16" if "avx512_fp16" in flags else "llama.cpp-avx512")
    assert numerics_.llama_float_order("llama.cpp") == numerics_.llama_float_order(model.numerics) > 0
    assert numerics_.llama_float_order("genkit") == 0


def test_continuous_batching_gives_the_same_logits(smollm2_llama):
    """The paged store's one-call steps (genkit serve): a prompt chunk and decode steps give the
    logits of generate()'s KV-cache steps, bit for bit."""
    from genkit.models.paged import StepBatch

    model, tok = smollm2_llama
    ids = tok.encode("def fibonacci(n):")
    tokens = NATIVE["def fibonacci(n):"][0][:4]
    store = model.new_paged_store(block_size=16, num_blocks=4)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=len(tokens), do_sample=False, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True).scores
        seq, cached = list(ids), 0
        for step in range(len(tokens)):
            new = seq[cached:]
            batch = StepBatch(torch.tensor(new), torch.arange(cached, len(seq)), [(0, len(new))], [cached], [[0, 1]],
                              [True])
            logits = model.forward_paged(batch, store)
            assert torch.equal(logits[0], ref[step][0].float()), step
            cached = len(seq)
            seq.append(tokens[step])


def test_a_long_prompt_runs_as_rows_of_one_call_steps_with_the_same_logits(smollm2_llama):
    """generate() runs a prompt as rows of one-call steps (PROMPT_ROWS tokens each; step row r is token
    r % T of cache row r // T): the logits equal continuous batching's single 45-row step and its next
    decode step bit for bit, and two rows with the same prompt get the one row's logits."""
    from genkit.models.block_decode import PROMPT_ROWS
    from genkit.models.paged import StepBatch

    model, tok = smollm2_llama
    ids = tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who "
                     "told the children stories about the storms, the whales and the lighthouse keeper.")
    assert len(ids) > PROMPT_ROWS
    kw = {"max_new_tokens": 2, "do_sample": False, "eos_token_id": None, "output_scores": True,
          "return_dict_in_generate": True}
    store = model.new_paged_store(block_size=16, num_blocks=8)
    with torch.inference_mode():
        one = model.generate(torch.tensor([ids]), **kw)
        two = model.generate(torch.tensor([ids, ids]), **kw)
        n = len(ids)
        prompt = model.forward_paged(StepBatch(torch.tensor(ids), torch.arange(n), [(0, n)], [0], [[0, 1, 2, 3, 4]],
                                               [True]), store)
        step = model.forward_paged(StepBatch(one.sequences[0, n:n + 1], torch.tensor([n]), [(0, 1)], [n],
                                             [[0, 1, 2, 3, 4]], [True]), store)
    assert torch.equal(prompt[0], one.scores[0][0].float()) and torch.equal(step[0], one.scores[1][0].float())
    for k in range(2):
        assert torch.equal(two.scores[k][0], one.scores[k][0]) and torch.equal(two.scores[k][1], one.scores[k][0])


def test_the_setting_is_refused_where_it_cannot_hold(tmp_path, smollm2_gguf, tiny_model):  # noqa: F811
    with pytest.raises(ConfigError, match=r"`numerics` must be one of 'genkit', 'llama.cpp', 'llama.cpp-avx2', "
                                          r"'llama.cpp-avx512', 'llama.cpp-avx512-fp16'; got 'ggml'"):
        genkit.load_model(smollm2_gguf, numerics="ggml")
    with pytest.raises(ConfigError, match="`activation_digits`=2 contradicts it"):
        genkit.load_model(smollm2_gguf, numerics="llama.cpp", activation_digits=2)
    with pytest.raises(ConfigError, match="applies to quantized GGUF models"):
        set_numerics(tiny_model, "llama.cpp")
    with pytest.raises(NotSupportedError, match="this model has genkit.quantize"):
        set_numerics(genkit.quantize(tiny_model, "int4"), "llama.cpp")
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_K", hidden=256, ffn=512)
    with pytest.raises(NotSupportedError, match="this model has Q4_K"):
        genkit.load_model(path, numerics="llama.cpp")


def test_calls_it_cannot_run_exactly_are_refused(tmp_path):
    """A padded batch, hidden states or attentions asked for, a hooked layer or autograd on would need
    the torch path or the modules: refused, not run with other numerics."""
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    model = genkit.load_model(path, numerics="llama.cpp")
    with torch.no_grad():
        model.generate(IDS[:1], max_new_tokens=3, do_sample=False)  # one sequence: runs
        with pytest.raises(NotSupportedError, match="no padding mask"):
            model.generate(IDS, attention_mask=MASK, max_new_tokens=3, do_sample=False)
        with pytest.raises(NotSupportedError, match="no hidden states"):
            model(IDS[:1], output_hidden_states=True)
        with pytest.raises(NotSupportedError, match=r"this call would run the model's modules \(attentions asked for\)"):
            model(IDS[:1], output_attentions=True)
        handle = model.model.layers[0].register_forward_hook(lambda *args: None)
        try:
            with pytest.raises(NotSupportedError, match=r"run the model's modules \(a layer replaced or hooked\)"):
                model(IDS[:1])
        finally:
            handle.remove()
    with torch.enable_grad(), pytest.raises(NotSupportedError, match=r"run the model's modules \(autograd is on: "
                                                                     r"call it under torch\.no_grad\(\) or "
                                                                     r"torch\.inference_mode\(\)\)"):
        model(IDS[:1])  # (the modules ran, with genkit's operations, before)
    set_numerics(model, "genkit")  # and back: the torch path again
    with torch.no_grad():
        assert len(model(IDS[:1], output_hidden_states=True).hidden_states) == 3


def test_the_cli_flag_reaches_the_model(smollm2_gguf, capsys):  # noqa: F811
    from genkit.cli import main

    prompt = "def fibonacci(n):"
    tok = genkit.load_tokenizer(smollm2_gguf)
    want = tok.decode(NATIVE[prompt][0][:20], skip_special_tokens=True)
    assert main(["generate", "--prompt", prompt, "--model", smollm2_gguf, "--max-new-tokens", "20",
                 "--set", "eos_token_id=null", "--numerics", "llama.cpp"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    assert main(["generate", "--prompt", prompt, "--model", smollm2_gguf, "--numerics", "ggml"]) == 2
    assert ("--numerics must be one of 'genkit', 'llama.cpp', 'llama.cpp-avx2', 'llama.cpp-avx512', "
            "'llama.cpp-avx512-fp16'; got 'ggml'" in capsys.readouterr().err)
    assert main(["serve", "--model", smollm2_gguf, "--numerics", "llama.cpp", "--activation-digits", "2"]) == 2
    assert "--activation-digits 2 contradicts it" in capsys.readouterr().err
    assert main(["batch", "in.jsonl", "out.jsonl", "--engine", "ray", "--numerics", "llama.cpp"]) == 2
    assert "--numerics applies to --engine local" in capsys.readouterr().err
