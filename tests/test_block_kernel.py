"""genkit's block kernel (genkit/models/block_kernel.c): products on GGUF-style blocks, its build
and cache, its portable loops, its switch, and batch-1 decode steps in one call
(genkit/models/block_decode.py) against the torch path they replace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_quantized import IDS, MASK, write_quantized_gguf
from tolerance import (
    U32,
    U_BLOCK_ACTIVATION_NORM,
    block_product_bound,
    gamma,
    hidden_bound,
    norm_and_head_bound,
)

import genkit
from genkit.errors import ConfigError
from genkit.models import block_kernel
from genkit.models.block_decode import BlockDecoder
from genkit.models.llama_infer import run_layers
from genkit.models.quant import Int4Linear, Int4Part

pytestmark = pytest.mark.skipif(not block_kernel.available(), reason="no C compiler for the block kernel")


def _weight(bits: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    group = 16 if bits == 6 else 32
    codes = torch.randint(0, 2 ** bits, (rows, cols), generator=g, dtype=torch.uint8)
    scale = (torch.rand(rows, cols // group, generator=g) * 0.02).half().float()
    minimum = (-torch.rand(rows, cols // group, generator=g) * 0.1 * (2 ** bits / 16)).half().float()
    if bits == 6:
        scale = scale * torch.randint(-128, 128, scale.shape, generator=g)  # Q6_K: float16 d times int8
        minimum = -32 * scale
    return codes, scale, minimum


def _dense(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    group = cols // scale.shape[1]
    return (codes.float().reshape(rows, -1, group) * scale[..., None] + minimum[..., None]).reshape(rows, cols)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 9])
def test_the_product_equals_the_float_product(bits, m):
    """Every row tile (1-4 activation rows at a time, then the rest): the float product of the
    float16 scales (Q6_K-style 6-bit codes: float32 scales per 16 weights) and the activations, to
    the two int8 digits' precision (1/64,516 of each block's largest activation)."""
    codes, scale, minimum = _weight(bits, 48, 256, seed=bits + m)
    x = torch.randn(m, 256) * torch.linspace(0.1, 10, 256)  # blocks of very different magnitudes
    got = block_kernel.matmul(x, block_kernel.pack(codes, scale, minimum, bits), bits, 48)
    dense = _dense(codes, scale, minimum)
    assert ((got - x @ dense.t()).abs() <= block_product_bound(x, dense)).all()


@pytest.mark.parametrize("act", [block_kernel.ACT_TWO, block_kernel.ACT_Q8_1])
@pytest.mark.parametrize("out", [64, 48])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_one_row_at_a_time_gives_the_rows_products_bit_for_bit(bits, out, act):
    """The one-row kernel of decode steps (AVX2: both halves of a panel in one pass; AVX-512: two
    panels at once, and the last one alone when their count is odd, as for 48 outputs), AVX2's
    two-row tile of 4-bit codes (rows2_avx2: 67 rows are 33 pairs and one row alone) and the
    quantization of many rows at once (vectorised, shared among threads) give exactly the bits of
    the row tiles of a prompt (and of a few rows: a continuous-batching step's): a token's logits do
    not depend on how many rows came with it."""
    codes, scale, minimum = _weight(bits, out, 1024, seed=bits)
    blocks = block_kernel.pack(codes, scale, minimum, bits)
    x = torch.randn(67, 1024, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.01, 30, 1024)
    together = block_kernel.matmul(x, blocks, bits, out, act)
    one_by_one = torch.cat([block_kernel.matmul(x[i:i + 1], blocks, bits, out, act) for i in range(x.shape[0])])
    assert torch.equal(together, one_by_one)
    for m in (2, 3, 4, 5, 9):  # few rows: each tile size its own loop, the first pass fetching ahead
        assert torch.equal(block_kernel.matmul(x[:m], blocks, bits, out, act), one_by_one[:m])


def _digits_reference(x: torch.Tensor, two: bool) -> torch.Tensor:
    """Each value of ``x`` (rows, K) as its activation digits give it back, computed in float32 by the
    rounding the kernel's top comment documents: per block of 32, d = amax / 127, q1 = rint(x * (127 /
    amax)) in [-127, 127]; with two digits q2 = rint((x - q1 * d) * (254 * (127 / amax))) and the value
    (d / 254) * (254 q1 + q2), with one (llama.cpp's Q8_1) fp16(d) * q1."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q1 = torch.round(blocks * inv).clamp(-127, 127)
    if not two:
        return (d.half().float() * q1).reshape(x.shape)
    q2 = torch.round((blocks - q1 * d) * (254.0 * inv)).clamp(-127, 127)
    return ((d / 254.0) * (254.0 * q1 + q2)).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("act", [block_kernel.ACT_TWO, block_kernel.ACT_Q8_1])
def test_activations_are_rounded_to_their_digits_bit_for_bit(act, rows):
    """Through an identity weight (code 1 on the diagonal, scale 1, offset 0) a product returns each
    activation as its digits give it back: the kernel's vectorised rounding (16 blocks at a time on
    AVX-512, then the 2 left of a 576-wide row) is the documented one to the bit, for blocks of very
    different magnitudes, an all-zero block and values at or next to halfway between two digits."""
    k = 576
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, k)
    x[0, 64:96] = 0.0  # a block of zeros: scale 0, digits 0
    x[-1, 128:160] = torch.arange(-16, 16) / 127.0 * 5 + 0.5 * 5 / 127.0  # at (or next to) halfway between digits
    x[-1, 159] = 5.0
    blocks = block_kernel.pack(torch.eye(k, dtype=torch.uint8), torch.ones(k, k // 32), torch.zeros(k, k // 32), 4)
    got = block_kernel.matmul(x, blocks, 4, k, act)
    assert torch.equal(got, _digits_reference(x, act == block_kernel.ACT_TWO))
    assert not torch.equal(got, x)  # (the rounding is there to see)


@pytest.mark.parametrize("act", [block_kernel.ACT_TWO, block_kernel.ACT_LLAMA_Q8_1])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bits", [4, 8])
def test_products_do_not_depend_on_how_many_threads_share_them(bits, rows, act):
    """Each thread takes its own contiguous range of panels, then helps with the others' (more
    threads than ranges, 70, start by helping): every panel is computed whole by one thread, so
    any thread count gives the bits of one thread, an odd panel count (67) and short last chunks
    included."""
    codes, scale, minimum = _weight(bits, 16 * 67, 256, seed=bits + rows)
    blocks = block_kernel.pack(codes, scale, minimum, bits)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * torch.linspace(0.1, 10, 256)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 7, 70):
            torch.set_num_threads(threads)
            results.append(block_kernel.matmul(x, blocks, bits, 16 * 67, act))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert not torch.equal(results[0], torch.zeros_like(results[0]))


def test_pack_refuses_other_widths():
    codes, scale, minimum = _weight(4, 16, 32)
    with pytest.raises(ValueError, match=r"`bits` must be 4, 6 or 8; got 5"):
        block_kernel.pack(codes, scale, minimum, 5)


def test_an_int8_weight_runs_as_one_8_bit_code_per_weight():
    codes, scale, minimum = _weight(8, 32, 64, seed=3)
    signed = codes.to(torch.int16) - 128  # as _q8_0 splits it: q = 16 * (hi - 8) + lo
    lo, hi = (signed & 0x0F).to(torch.uint8), ((signed >> 4) + 8).to(torch.uint8)
    d = scale
    layer = Int4Linear(64, 32, [Int4Part(lo, d, torch.zeros_like(d)), Int4Part(hi, 16 * d, -128 * d)], kernel="blocks")
    assert layer.bits == 8 and layer.blocks.shape == (2, 2, block_kernel.block_bytes(8))
    x = torch.randn(2, 64)
    dense = (signed.float().reshape(32, 2, 32) * d[..., None]).reshape(32, 64)
    assert ((layer(x) - x @ dense.t()).abs() <= block_product_bound(x, dense)).all()


def _run(code: str, env: dict[str, str], *args: str) -> str:
    """``code`` in a fresh interpreter with ``env`` over this one's (a build mode forced for the whole
    run, GENKIT_BLOCK_KERNEL, is not inherited: the cases here say which build they want)."""
    inherited = {k: v for k, v in os.environ.items() if k != "GENKIT_BLOCK_KERNEL"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env={**inherited, **env}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


PRODUCT = """
import json, sys, torch
from genkit.models import block_kernel as bk
g = torch.Generator().manual_seed(0)
out = {}
for bits in (4, 6, 8):
    group = 16 if bits == 6 else 32
    codes = torch.randint(0, 2 ** bits, (64, 128), generator=g, dtype=torch.uint8)
    scale, minimum = torch.rand(64, 128 // group, generator=g) / 50, -torch.rand(64, 128 // group, generator=g) / 10
    if bits == 6:
        minimum = -32 * scale
    x = torch.randn(5, 128, generator=g)
    dense = codes.float() * scale.repeat_interleave(group, 1) + minimum.repeat_interleave(group, 1)
    packed = bk.pack(codes, scale, minimum, bits)
    out[bits] = [bk.matmul(x, packed, bits, 64).tolist(), x.tolist(), dense.tolist()]
    out[f"{bits} one row"] = bk.matmul(x[:1], packed, bits, 64).tolist()  # batch-1 decode's own loop
    out[f"{bits} few rows"] = [bk.matmul(x[:m], packed, bits, 64).tolist() for m in (2, 3)]  # their own tiles
print(json.dumps({"simd": bk.simd(), "out": out}))
"""


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


FLAGS = _cpu_flags() if os.path.exists("/proc/cpuinfo") else set()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
# what -march=native builds on this CPU
HAS_AVX_VNNI = HAS_AVX2 and "avx_vnni" in FLAGS
NATIVE = ("avx512-vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= FLAGS
          else "avx-vnni" if HAS_AVX_VNNI else "avx2" if HAS_AVX2 else "")


def test_the_portable_loops_agree_with_the_vector_kernels(tmp_path):
    """The native build takes the CPU's best vector path; the portable build (forced) and the AVX2
    build compute the same products; the AVX-VNNI build (where the CPU has it) gives the AVX2
    build's results bit for bit (the same integer sums, the same float steps); each library lands in
    the cache folder, written whole (no build folder left behind)."""
    native = json.loads(_run(PRODUCT, {"GENKIT_HOME": str(tmp_path)}))
    portable = json.loads(_run(PRODUCT, {"GENKIT_HOME": str(tmp_path), "GENKIT_BLOCK_KERNEL": "portable"}))
    builds = [native, portable]
    if HAS_AVX2:
        builds.append(json.loads(_run(PRODUCT, {"GENKIT_HOME": str(tmp_path), "GENKIT_BLOCK_KERNEL": "avx2"})))
        assert builds[-1]["simd"] == "avx2"
    if HAS_AVX_VNNI:
        builds.append(json.loads(_run(PRODUCT, {"GENKIT_HOME": str(tmp_path), "GENKIT_BLOCK_KERNEL": "avx-vnni"})))
        assert builds[-1]["simd"] == "avx-vnni" and builds[-1]["out"] == builds[-2]["out"]
    assert portable["simd"] == ""
    if NATIVE:  # (a CPU with neither runs torch's kernels by default: no library is loaded)
        assert native["simd"] == NATIVE
    for build in builds:  # each build: a product of 2 or 3 rows gives the rows of the 5-row product, bit for bit
        for bits in ("4", "6", "8"):
            assert build["out"][f"{bits} few rows"] == [build["out"][bits][0][:m] for m in (2, 3)]
    for other in builds[1:]:
        for bits in ("4", "6", "8"):
            (a, x, dense), b = map(torch.tensor, native["out"][bits]), torch.tensor(other["out"][bits][0])
            # each build is within block_product_bound of the exact product
            assert ((a - b).abs() <= 2 * block_product_bound(x, dense)).all()
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir() if p.name != ".build.lock")
    libraries = [n for n in built if n.endswith(".so")]
    assert len(libraries) == len(builds) and all(n.startswith("genkit_blocks-") for n in libraries), built
    assert sorted(n + ".sha256" for n in libraries) == [n for n in built if n.endswith(".sha256")], built
    again = json.loads(_run(PRODUCT, {"GENKIT_HOME": str(tmp_path)}))  # cached: same library, same numbers
    assert again == native and sorted(p.name for p in (tmp_path / "kernels").iterdir() if p.name != ".build.lock") == built


def test_the_switch_turns_the_kernel_off_or_names_its_values(tmp_path):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    code = ("import sys, genkit\nm = genkit.load_model(sys.argv[1])\n"
            "print(m.model.layers[0].self_attn.q_proj.kernel)")
    assert _run(code, {"GENKIT_BLOCK_KERNEL": "0"}, str(path)) == "torch"
    assert _run(code, {"GENKIT_BLOCK_KERNEL": "1"}, str(path)) == ("blocks" if NATIVE else "torch")
    assert _run(code, {"GENKIT_BLOCK_KERNEL": "portable"}, str(path)) == "blocks"
    bad = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         env={**os.environ, "GENKIT_BLOCK_KERNEL": "fast"}, timeout=300)
    assert bad.returncode != 0
    assert "GENKIT_BLOCK_KERNEL must be one of '0', '1', 'portable', 'avx2', 'avx-vnni'; got 'fast'" in bad.stderr


# -- batch-1 decode steps in one call -----------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("blocks")) / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    model = genkit.load_model(path)
    with torch.no_grad():
        model(IDS[:1])  # prepares the inference weights
    return model


def _prefilled(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=True).past_key_values


def one_call_and_torch_path(prepared, x, cos, sin, ours_cache, torch_cache, num_layers):
    """A decode step through the prepared model's one-call decoder and through the per-layer torch
    path (the decoder set aside meanwhile), each on its own cache."""
    decoder = prepared.decoder
    ours = decoder(x, cos, sin, {None: None}, ours_cache, num_layers)
    prepared.decoder = None
    try:
        want = run_layers(prepared, x, cos, sin, {None: None}, torch_cache, None, num_layers)
    finally:
        prepared.decoder = decoder
    return ours, want


@pytest.mark.parametrize(("num_layers", "rows"), [(None, 1), (1, 1), (None, 3)])
def test_a_decode_step_in_one_call_equals_the_torch_path(quantized, num_layers, rows):
    prepared = quantized._prepared[1]
    decoder = prepared.decoder
    assert isinstance(decoder, BlockDecoder)
    ids = torch.tensor([[1, 17, 33, 5, 250, 9], [3, 4, 5, 6, 7, 8], [9, 9, 9, 1, 2, 3]])[:rows]
    pos = ids.shape[1]
    x = torch.randn(rows, 1, quantized.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    cos, sin = quantized.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
    with torch.no_grad():
        ours_cache, torch_cache = _prefilled(quantized, ids), _prefilled(quantized, ids)
        ours, want = one_call_and_torch_path(prepared, x, cos, sin, ours_cache, torch_cache, num_layers)
    # the same computation summed in another order; where that moves an activation across a
    # rounding boundary of its second int8 digit, the value moves by 1/64,516 of its block's largest
    assert ours is not None
    n = num_layers or len(prepared.layers)
    config, u = quantized.config, U_BLOCK_ACTIVATION_NORM
    torch.testing.assert_close(ours, want, rtol=0, atol=hidden_bound(config, pos + 1, n, want, linear_u=u))
    assert ours_cache.lengths == torch_cache.lengths == [pos + 1] * n + [pos] * (len(prepared.layers) - n)
    for i, length in enumerate(ours_cache.lengths):
        for got, ref in ((ours_cache.keys[i], torch_cache.keys[i]), (ours_cache.values[i], torch_cache.values[i])):
            # the prompt's entries come from the same prefill; the new position's, past the first
            # layer, from inputs that differ as the outputs above do
            torch.testing.assert_close(got[:, :, :pos], ref[:, :, :pos], rtol=0, atol=0)
            new, want_new = got[:, :, pos:length], ref[:, :, pos:length]
            if new.numel():
                # (layer i's keys and values: i blocks, then one more projection: within i + 1 blocks' bound)
                atol = hidden_bound(config, pos + 1, i + 1, want_new, linear_u=u)
                torch.testing.assert_close(new, want_new, rtol=0, atol=atol)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_quantized_gpt2s_decode_step_in_one_call_equals_the_torch_path(tmp_path, rows):
    """GPT-2 quantized by ``genkit.quantize`` (its Conv1D projections block weights with float
    biases): a decode step runs in one block-kernel call, LayerNorms, biases and GELU's tanh form
    included, within the bound of the same computation summed in another order (with the
    activations' second int8 digit) of the torch path, which runs the same block products."""
    from test_quantized import _tiny_gpt2

    from genkit import quantize

    if not block_kernel.available():
        pytest.skip("no C compiler: the block kernel does not exist here")
    model = quantize(_tiny_gpt2(tmp_path), "int8")
    ids = torch.tensor([[1, 17, 33, 5, 250, 9], [3, 4, 5, 6, 7, 8]])[:rows]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)
    prepared = model._prepared[1]
    assert isinstance(prepared.decoder, BlockDecoder) and not prepared.decoder.dense
    assert all(t.gelu == t.no_rope == 1 and t.b_qkv and t.norm2_b for t in prepared.decoder.table)
    pos = ids.shape[1]
    x = torch.randn(rows, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        ours_cache, torch_cache = _prefilled(model, ids), _prefilled(model, ids)
        ours, want = one_call_and_torch_path(prepared, x, None, None, ours_cache, torch_cache, None)
    assert ours is not None and not torch.equal(ours, x)
    atol = hidden_bound(model.config, pos + 1, len(prepared.layers), want, linear_u=U_BLOCK_ACTIVATION_NORM)
    torch.testing.assert_close(ours, want, rtol=0, atol=atol)
    assert ours_cache.lengths == torch_cache.lengths == [pos + 1] * len(prepared.layers)


def test_what_the_one_call_cannot_take_goes_the_torch_way(quantized):
    decoder = quantized._prepared[1].decoder
    x = torch.randn(1, 1, quantized.config.hidden_size)
    cos, sin = quantized.rope(torch.tensor([[6]]), x.dtype, 6, 1)
    cache = _prefilled(quantized, IDS[:1])
    with torch.no_grad():
        assert decoder(x, cos, sin, {None: torch.zeros(1, 1, 1, 7, dtype=torch.bool)}, cache, None) is None  # a mask
        assert decoder(x.expand(2, 1, -1), cos, sin, {None: None}, cache, None) is None  # rows the cache lacks
        assert decoder(x.double(), cos, sin, {None: None}, cache, None) is None
        assert decoder(x, cos, sin, {None: None}, None, None) is None  # no cache
        cache.lengths[1] -= 1  # layers out of step
        assert decoder(x, cos, sin, {None: None}, cache, None) is None


def test_the_one_call_checks_a_cache_again_when_its_buffers_change(quantized):
    """The decoder keeps a cache's checked buffers and pointer arrays between steps; a cache whose
    buffers were replaced (here: reordered into 2 rows) is checked again, and written where it now is
    (the same as a cache it meets for the first time after the same steps)."""
    prepared = quantized._prepared[1]
    decoder = prepared.decoder
    x = torch.randn(1, 1, quantized.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, ref = _prefilled(quantized, IDS[:1]), _prefilled(quantized, IDS[:1])
        for cache in (ours, ref):
            for pos in (6, 7):
                cos, sin = quantized.rope(torch.tensor([[pos]]), x.dtype, pos, 1)
                assert decoder(x, cos, sin, {None: None}, cache, None) is not None
            cache.reorder(torch.tensor([0, 0]))  # new buffers (as beam search makes each step), 2 rows
        cos, sin = quantized.rope(torch.tensor([[8]]), x.dtype, 8, 1)
        x2 = torch.cat([x, -x])
        assert decoder(x2[:1], cos, sin, {None: None}, ours, None) is None  # 2 rows held now
        got = decoder(x2, cos, sin, {None: None}, ours, None)
        want = decoder(x2, cos, sin, {None: None}, ref, None)
    assert got is not None and want is not None and torch.equal(got, want)
    for a, b in zip(ours.keys + ours.values, ref.keys + ref.values):
        assert torch.equal(a[:, :, :9], b[:, :, :9])


def test_generation_gives_the_torch_paths_tokens(quantized):
    """Greedy on one prompt (decode steps in one call), on a padded batch (the torch path),
    sampling, several samples of one prompt and beams (several rows in one call), against the same
    model with the one-call path off."""
    prepared = quantized._prepared[1]
    kw = {"max_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}

    def outputs():
        torch.manual_seed(0)
        return (quantized.generate(IDS[:1], **kw), quantized.generate(IDS, attention_mask=MASK, **kw),
                quantized.generate(IDS[:1], do_sample=True, top_k=20, **kw),
                quantized.generate(IDS[:1], do_sample=True, num_return_sequences=3, **kw),
                quantized.generate(IDS[:1], num_beams=3, num_return_sequences=2, **kw))

    ours = outputs()
    decoder, prepared.decoder = prepared.decoder, None
    try:
        want = outputs()
    finally:
        prepared.decoder = decoder
    for a, b in zip(ours, want):
        assert torch.equal(a, b)


# -- a decode step with its ends (embedding, final norm, LM head) in the same call ---------------------

def _step(model, cache, token, **kw):
    with torch.no_grad():
        return model(torch.tensor([[token]]), past_key_values=cache, **kw).logits


def _on_the_usual_path(model):
    """A forward hook on the final norm: the step's ends must run as modules (the hook sees the norm's
    output once per step)."""
    seen = []
    handle = model.model.norm.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().clone()))
    return handle, seen


@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_step_with_its_ends_in_one_call_equals_the_modules(quantized, rows):
    """The step from token ids to logits in one kernel call (embedding, layers, final norm, LM head)
    against the same step with the ends run as modules (a hook on the final norm keeps them there):
    the layers and the embedding are the same computation, the final norm is summed in another order,
    and the head is the same product on the norm's output (tolerance.norm_and_head_bound)."""
    ids = IDS[:1].expand(rows, -1)
    with torch.no_grad():
        fast_cache, usual_cache = quantized(ids).past_key_values, quantized(ids).past_key_values
    tokens = torch.tensor([[7], [250], [3]])[:rows]
    with torch.no_grad():
        fast = quantized(tokens, past_key_values=fast_cache).logits
        assert quantized._prepared[1].decoder._ends[1] is not None  # the step took its ends into the call
        handle, seen = _on_the_usual_path(quantized)
        try:
            usual = quantized(tokens, past_key_values=usual_cache).logits
        finally:
            handle.remove()
    assert len(seen) == 1 and fast.shape == usual.shape == (rows, 1, quantized.config.vocab_size)
    assert fast_cache.lengths == usual_cache.lengths == [7] * len(fast_cache.lengths)
    for a, b in zip(fast_cache.keys + fast_cache.values, usual_cache.keys + usual_cache.values):
        assert torch.equal(a[:, :, :7], b[:, :, :7])  # the same layers on the same embedding
    h = seen[0].reshape(rows, -1)
    with torch.no_grad():
        w = quantized.lm_head(torch.eye(h.shape[1])).t()  # (vocab, hidden): the head's rows
    assert ((fast.reshape(rows, -1) - usual.reshape(rows, -1)).abs() <= norm_and_head_bound(h, w)).all()


def test_a_decode_step_in_one_call_honours_positions_masks_and_bad_ids(quantized):
    """Positions and a mask that a cache implies give the one-call step's logits; other positions take
    the usual path and count (the logits move); a token id outside the vocabulary is refused by the
    embedding as on the usual path, with the cache left as it was."""
    with torch.no_grad():
        caches = [quantized(IDS[:1]).past_key_values for _ in range(4)]
    plain = _step(quantized, caches[0], 9)
    implied = _step(quantized, caches[1], 9, attention_mask=torch.ones(1, 7, dtype=torch.long),
                    position_ids=torch.tensor([[6]]))
    assert torch.equal(plain, implied)
    moved = _step(quantized, caches[2], 9, position_ids=torch.tensor([[9]]))
    assert not torch.allclose(moved, plain)
    with pytest.raises(IndexError):
        _step(quantized, caches[3], quantized.config.vocab_size)
    assert caches[3].lengths == [6] * len(caches[3].lengths)


def test_llama_numerics_one_call_step_is_bit_identical_to_the_modules(tmp_path):
    """Under numerics="llama.cpp" the final norm is ggml's in both places (rms_norm_llama): the
    one-call step's logits equal those of the same step with the ends run as modules, bit for bit."""
    from genkit.models.quant import set_numerics

    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    model = set_numerics(genkit.load_model(path), "llama.cpp")
    with torch.no_grad():
        fast_cache, usual_cache = model(IDS[:1]).past_key_values, model(IDS[:1]).past_key_values
    fast = _step(model, fast_cache, 11)
    handle, seen = _on_the_usual_path(model)
    try:
        usual = _step(model, usual_cache, 11)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(fast, usual)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 2, 16, 5), (4, 4, 8, 16), (6, 3, 12, 4)])
def test_attention_over_the_paged_store_in_place_equals_attention_over_gathered_blocks(heads, kv_heads, head_dim,
                                                                                      block_size):
    """block_kernel.attend_paged (continuous batching's float32 torch path: decoding rows attend over
    their blocks where they are) against float64 attention over each row's blocks gathered in order,
    within the bound of two float32 evaluations: scores of head_dim terms, a softmax of n + 1 terms and
    the weighted values of n terms (tests/tolerance.py), the exp within 4 units of roundoff (ggml's
    vector expf is within 1.5 ulp, SLEEF's within 1)."""
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    keys, values = (torch.randn(24, kv_heads, block_size, head_dim, generator=g) for _ in range(2))
    positions = torch.tensor([0, 3 * block_size + 1, 5 * block_size - 1])
    table = torch.stack([torch.randperm(24, generator=g)[:5] for _ in positions])  # 5 blocks each, any order
    q = torch.randn(len(positions), heads, head_dim, generator=g) * 2
    got = block_kernel.attend_paged(q, keys, values, table, positions, block_size)
    group, scale = heads // kv_heads, head_dim ** -0.5
    for r, last in enumerate(positions.tolist()):
        k, v = (c[table[r]].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :last + 1].double()
                for c in (keys, values))  # (kv_heads, n, d)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qd = q[r].double()[:, None]  # (heads, 1, d)
        p = torch.softmax((qd @ k.transpose(1, 2)) * scale, -1)  # (heads, 1, n)
        want = (p @ v)[:, 0]
        n = last + 1
        score_err = 2 * gamma(head_dim) * scale * (qd.abs() @ k.abs().transpose(1, 2)).amax(-1, keepdim=True)
        rel = 2 * score_err + 2 * 4 * U32 + 4 * gamma(n + 1)  # each weight's relative error, two evaluations
        bound = ((rel + 2 * gamma(n)) * (p @ v.abs()))[:, 0]
        assert ((got[r].double() - want).abs() <= bound * 1.01 + 1e-30).all(), (r, float((got[r] - want).abs().max()))


def test_attention_over_the_paged_store_refuses_shapes_it_does_not_take_by_name():
    """A head size the kernel's attention does not take is declined up front (``attends``, so the
    step keeps SDPA) and refused with the accepted shapes when asked anyway."""
    assert block_kernel.attends(64) and not block_kernel.attends(7) and not block_kernel.attends(1024)
    keys = torch.zeros(2, 1, 4, 7)
    with pytest.raises(ConfigError, match=r"an even head_dim <= 512 \(`attends`\); got heads=2, kv_heads=1, head_dim=7"):
        block_kernel.attend_paged(torch.zeros(1, 2, 7), keys, keys, torch.zeros(1, 1, dtype=torch.int32),
                                  torch.tensor([0]), 4)
