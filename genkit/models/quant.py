"""Weight-only low-bit linear layers for the CPU: GGUF blocks run as they are stored.

Each group of 32 weights of an output row is ``scale * q + minimum`` with a 4-bit code ``q``
(GGUF ``Q4_0``: ``d * (q - 8)``, ``Q4_1``: ``d * q + m``, each 32-weight sub-block of ``Q4_K``), or
an 8-bit one (``Q8_0``, held as two exact 4-bit halves ``q = 16 * hi + lo`` in :class:`Int4Part`
form). :class:`Int4Linear` runs them on one of two kernels:

- ``"blocks"`` (the default where a C compiler is found): genkit's block kernel
  (:mod:`genkit.models.block_kernel`), which keeps the codes in GGUF-style blocks with float16
  scales and rounds activations to two int8 digits, so its products are as exact as the float16
  scales (see that module);
- ``"torch"``: torch's int4 weight-only kernel (``torch.ops.aten._weight_int4pack_mm_for_cpu``),
  one group of which is exactly one GGUF block, computing ``(q - 8) * scale + zero``; it takes
  bfloat16 activations and scales (8 significant bits; GGUF stores float16), and 8-bit weights run
  as two int4 products.

``genkit.quantize(model, "int8" | "int4")`` quantizes the linear layers of any native model the
same way (weight-only, symmetric groups of 32 with float16 scales; int4's zero point at
``-8 * scale``; int8 as two int4 halves).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import (
    ArgumentTypeError,
    ConfigError,
    KernelUnavailableError,
    NotSupportedError,
    UnsupportedModelError,
)
from . import block_kernel
from .numerics import NUMERICS, check_numerics, is_llama_numerics, native_llama_numerics
from .quant_weight import QuantizedWeightModule, blocks_weight

logger = logging.getLogger("genkit.models")

GROUP = 32  # GGUF's block size for Q4_0/Q4_1/Q8_0 and Q4_K's sub-blocks
ACT_DTYPE = torch.bfloat16
_MIN_ROWS = 16  # the packing kernel needs out_features divisible by 16
_PACK_TILE = 64  # ... and lays rows out in tiles of 64 (packed layers concatenate at tile borders)
PACK_CHUNK = 16 * _PACK_TILE  # rows decoded and packed at a time
KERNELS = ("auto", "blocks", "torch")

__all__ = ["Int4Linear", "Int4Part", "QuantizedEmbedding", "WithBias", "kernel_available", "quantize",
           "set_activation_digits", "set_numerics", "check_numerics", "NUMERICS"]


def kernel_available() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernels."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), 2)
        sz = torch.zeros(2, 16, 2, dtype=ACT_DTYPE)
        torch.ops.aten._weight_int4pack_mm_for_cpu(torch.zeros(1, 64, dtype=ACT_DTYPE), packed, GROUP, sz)
        return True
    except (RuntimeError, AttributeError) as exc:
        logger.debug("int4 weight-only kernels unavailable: %s", exc)
        return False


def int4_shape_ok(out_features: int, in_features: int, padded: bool = False) -> bool:
    """Whether :class:`Int4Linear` takes a weight of ``(out_features, in_features)``: rows a
    multiple of 16 (the kernels' panels; any number with ``padded``: the block kernel's layers pad
    their last panel with rows of zeros), columns of 32 (a group)."""
    return out_features > 0 and (padded or out_features % _MIN_ROWS == 0) and in_features % GROUP == 0


class Int4Part:
    """One low-bit weight matrix: codes ``q`` with ``w = scale * q + minimum`` per group of ``group``
    input weights (``q``: ``(out, in)``, ``scale``/``minimum``: ``(out, in / group)``). Codes are 4-bit
    (0-15, groups of 32) for both kernels; the block kernel also takes GGUF Q6_K's 6-bit codes in
    groups of 16."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int = GROUP) -> None:
        self.q, self.scale, self.minimum, self.group = q, scale, minimum, group

    def rows(self, index: Any) -> Int4Part:
        return Int4Part(self.q[index], self.scale[index], self.minimum[index], self.group)

    def dense(self) -> torch.Tensor:
        """The float32 weight these codes stand for (a reference; the layers never build it)."""
        out, k = self.q.shape
        g = self.group
        w = self.q.float().reshape(out, k // g, g) * self.scale.float()[..., None] + self.minimum.float()[..., None]
        return w.reshape(out, k)


def _block_codes(parts: list[Int4Part], source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(codes, scale, minimum, bits)`` of one weight for the block kernel: a single 4-bit part, or
    an 8-bit weight split as ``lo`` (scale ``d``, offset 0) plus ``hi`` (scale ``16 d``): its code
    ``16 * hi + lo`` with scale ``d`` and ``hi``'s offset."""
    if len(parts) == 1:
        p = parts[0]
        codes, scale, minimum, bits = p.q, p.scale, p.minimum, (4 if p.group == GROUP else 6)
        if p.group not in (GROUP, GROUP // 2):
            raise UnsupportedModelError(f"{source or 'int4 layer'}: groups of {p.group} weights; the block kernel takes 32 or 16")
    elif (len(parts) == 2 and not bool(parts[0].minimum.any())
          and torch.equal(parts[1].scale.float(), 16.0 * parts[0].scale.float())):
        lo, hi = parts
        codes = (hi.q.to(torch.int32) * 16 + lo.q.to(torch.int32)).to(torch.uint8)
        scale, minimum, bits = lo.scale, hi.minimum, 8
    else:
        raise UnsupportedModelError(f"{source or 'int4 layer'}: {len(parts)} int4 parts do not form a 4- or 8-bit weight")
    if bits == 6 and not torch.equal(minimum.float(), -32.0 * scale.float()):
        raise UnsupportedModelError(f"{source or 'int4 layer'}: 6-bit codes in groups of 16 need offsets of -32 * scale (GGUF Q6_K)")
    if bits != 6 and not block_kernel.fits_float16(scale, minimum):
        raise UnsupportedModelError(f"{source or 'int4 layer'}: scales overflow float16, which the block kernel stores; "
                                    "set GENKIT_BLOCK_KERNEL=0 to use torch's int4 kernel")
    return codes, scale, minimum, bits


def part_rows(parts: list[Int4Part], start: int, stop: int) -> list[Int4Part]:
    return [p.rows(slice(start, stop)) for p in parts]


class Int4Linear(QuantizedWeightModule):
    """A bias-free linear layer whose weight is a sum of int4 parts (one for 4-bit formats, two for
    8-bit ones), run by torch's int4 weight-only CPU kernel. ``(…, in) -> (…, out)``.

    ``weight`` (read-only; :class:`~genkit.models.quant_weight.QuantizedWeightModule`): the float32
    ``(out, in)`` weight it computes with, de-quantized on each read (:meth:`dequantized_weight`)."""

    # the block kernel's products of this many rows and more run on AMX tiles (0: never); a prepared model's
    # weights take their model's kernel choice (llama_infer.blocks_choice), every way a layer is made starts at 0
    amx_rows = 0

    def __init__(self, in_features: int, out_features: int, parts: list[Int4Part] | None = None, source: str = "",
                 row_chunks: Iterable[list[Int4Part]] | None = None, kernel: str = "auto") -> None:
        """``parts`` (the whole matrix), or ``row_chunks``: the parts of consecutive blocks of rows
        (each a multiple of 64 rows but the last), so that a big matrix is never decoded at once.

        ``kernel``: ``"blocks"`` (genkit's block kernel, :mod:`genkit.models.block_kernel`),
        ``"torch"`` (torch's int4 kernel) or ``"auto"`` (the block kernel where it can be built)."""
        super().__init__()
        if kernel not in KERNELS:
            raise ConfigError(f"`kernel` must be one of {', '.join(repr(k) for k in KERNELS)}; got {kernel!r}")
        if kernel == "blocks" and not block_kernel.available():
            raise KernelUnavailableError("the block kernel is not available (no C compiler, or GENKIT_BLOCK_KERNEL=0)")
        self.kernel = "blocks" if kernel == "blocks" or (kernel == "auto" and block_kernel.available()) else "torch"
        if not int4_shape_ok(out_features, in_features, padded=self.kernel == "blocks"):
            rows = "out_features >= 1" if self.kernel == "blocks" else f"out_features divisible by {_MIN_ROWS}"
            raise ConfigError(f"int4 kernels need {rows} and in_features divisible by {GROUP}; "
                              f"got ({out_features}, {in_features})")
        self.in_features, self.out_features, self.source = in_features, out_features, source
        if row_chunks is None:
            assert parts is not None
            row_chunks = (part_rows(parts, start, start + PACK_CHUNK) for start in range(0, out_features, PACK_CHUNK))
        self.bits = 4
        self.symmetric = False  # m = -2**(bits-1) * d in every block (see block_kernel.act_mode)
        self.activation_digits = 2  # int8 digits per activation value on the block kernel (set_activation_digits)
        self.numerics = "genkit"  # or "llama.cpp": the products in llama.cpp's float order (set_numerics)
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.kernel == "blocks":
            self._pack_blocks(row_chunks)
            return
        packed: list[list[torch.Tensor]] = []
        scales: list[list[torch.Tensor]] = []
        for chunk in row_chunks:
            if any(part.group != GROUP for part in chunk):
                raise UnsupportedModelError(f"{source or 'int4 layer'}: torch's int4 kernel takes groups of {GROUP} weights; "
                                            f"got {chunk[0].group} (GGUF Q6_K needs the block kernel)")
            for i, part in enumerate(chunk):
                if i == len(packed):
                    packed.append([])
                    scales.append([])
                packed[i].append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(part.q.to(torch.int32), 2))
                zero = part.minimum.float() + 8 * part.scale.float()  # the kernel subtracts 8 from each code
                scales[i].append(torch.stack([part.scale.float(), zero], dim=-1).transpose(0, 1).to(ACT_DTYPE))
        for i in range(len(packed)):
            self.register_buffer(f"packed{i}", torch.cat(packed[i]))
            self.register_buffer(f"scales{i}", torch.cat(scales[i], dim=1).contiguous())
        if sum(p.shape[0] for p in packed[0]) != out_features:
            raise ConfigError(f"int4 parts hold {sum(p.shape[0] for p in packed[0])} rows; expected {out_features}")
        self.num_parts = len(packed)
        self._parts = [(getattr(self, f"packed{i}"), getattr(self, f"scales{i}")) for i in range(self.num_parts)]

    def _pack_blocks(self, row_chunks: Iterable[list[Int4Part]]) -> None:
        """Store the rows in the block kernel's layout: one 4-bit part as it is, an 8-bit weight's
        two halves joined back into one 8-bit code per weight; rows of zeros after a last panel of
        fewer than 16 (:attr:`panel_rows`)."""
        chunks, bits, symmetric = [], None, True
        for chunk in row_chunks:
            codes, scale, minimum, chunk_bits = _block_codes(chunk, self.source)
            short = -codes.shape[0] % block_kernel.ROWS
            if short:  # (codes 0 with scale and minimum 0: weights of zero, never read as logits)
                codes, scale, minimum = (F.pad(t, (0, 0, 0, short)) for t in (codes, scale, minimum))
            if bits is not None and chunk_bits != bits:
                raise UnsupportedModelError(f"{self.source or 'int4 layer'}: row chunks mix {bits}- and {chunk_bits}-bit codes")
            bits = chunk_bits
            symmetric = symmetric and torch.equal(minimum.float(), -float(2 ** (bits - 1)) * scale.float())
            chunks.append(block_kernel.pack(codes, scale, minimum, chunk_bits))
        blocks = torch.cat(chunks)
        if blocks.shape[0] != -(-self.out_features // block_kernel.ROWS):
            raise ConfigError(f"int4 parts hold {blocks.shape[0] * block_kernel.ROWS} rows; expected {self.out_features}")
        self.register_buffer("blocks", blocks)
        self.bits = int(bits or 4)
        self.symmetric = symmetric
        self.num_parts = 1

    @property
    def panel_rows(self) -> int:
        """The rows the block kernel computes: ``out_features`` rounded up to its panels of 16 (the
        rows past ``out_features`` are zeros); ``out_features`` on torch's kernel."""
        return -(-self.out_features // block_kernel.ROWS) * block_kernel.ROWS if self.kernel == "blocks" else self.out_features

    @property
    def act(self) -> int:
        """The block kernel's activation rounding for this layer (:func:`block_kernel.act_mode`; with
        ``numerics="llama.cpp"``, the same one-digit rounding summed in llama.cpp's order)."""
        act = block_kernel.act_mode(self.activation_digits, self.symmetric)
        return block_kernel.llama_order(act) if is_llama_numerics(getattr(self, "numerics", "genkit")) else act

    def _apply(self, fn: Any, recurse: bool = True) -> Int4Linear:
        out = super()._apply(fn, recurse)
        if self.kernel == "blocks":
            return out
        self._parts = [(getattr(self, f"packed{i}"), getattr(self, f"scales{i}")) for i in range(self.num_parts)]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "blocks":
            n = self.out_features
            y = block_kernel.matmul(flat, self.blocks, self.bits, self.panel_rows, self.act, self.amx_rows)
            y = y if y.shape[1] == n else y[:, :n]  # (a padded last panel's rows left out)
            return (y if x.dtype == torch.float32 else y.to(x.dtype)).reshape(*shape[:-1], n)
        if flat.dtype != ACT_DTYPE:
            flat = flat.to(ACT_DTYPE)
        out = None
        for packed, sz in self._parts:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, sz)
            out = y if out is None else out.add_(y)
        assert out is not None
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``(out_features, in_features)`` weight this layer computes with. On the block
        kernel: its codes, scales and offsets (:func:`~genkit.models.quant_weight.blocks_weight`). On
        torch's int4 kernel: the kernel's own weights at its activation dtype's precision (bfloat16),
        the products of an identity matrix of ``in_features`` rows through :meth:`forward` (an 8-bit
        weight's two parts summed as there), transposed."""
        if self.kernel == "blocks":
            return blocks_weight(self.blocks, self.bits, self.out_features)
        k = self.in_features
        weight = torch.empty(self.out_features, k, dtype=torch.float32)
        for start in range(0, k, PACK_CHUNK):  # (an identity of PACK_CHUNK rows at a time)
            stop = min(start + PACK_CHUNK, k)
            eye = torch.zeros(stop - start, k, dtype=ACT_DTYPE)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1
            weight[:, start:stop] = self.forward(eye).t()
        return weight

    @staticmethod
    def from_blocks(blocks: torch.Tensor, in_features: int, out_features: int, bits: int, symmetric: bool,
                    source: str = "") -> Int4Linear:
        """A block-kernel layer on ``blocks`` already in the kernel's layout (``(out / 16, in / 32,
        bytes)``, as :func:`block_kernel.head_proxy` makes them for bits 8)."""
        panels = -(-out_features // block_kernel.ROWS)
        if tuple(blocks.shape) != (panels, in_features // GROUP, block_kernel.BLOCK_BYTES[bits]):
            raise ConfigError(f"blocks of shape {tuple(blocks.shape)} do not hold a ({out_features}, {in_features}) "
                              f"{bits}-bit weight")
        layer = Int4Linear.__new__(Int4Linear)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features, layer.source = in_features, out_features, source
        layer.kernel, layer.bits, layer.num_parts, layer.symmetric = "blocks", bits, 1, symmetric
        layer.activation_digits, layer.numerics, layer._parts = 2, "genkit", []
        layer.register_buffer("blocks", blocks)
        return layer

    @staticmethod
    def fuse(layers: list[Int4Linear]) -> Int4Linear | None:
        """One layer computing the concatenation of the layers' outputs, or None when the packed
        layout does not allow it (it packs rows in tiles of 64: every layer but the last needs a
        multiple of 64 outputs)."""
        first = layers[0]
        if any(lay.num_parts != first.num_parts or lay.in_features != first.in_features or lay.kernel != first.kernel
               or lay.bits != first.bits for lay in layers):
            raise ConfigError("fused int4 layers need the same input size, kernel and number of parts")
        if first.kernel == "torch" and any(lay.out_features % _PACK_TILE for lay in layers[:-1]):
            return None
        if any(lay.panel_rows != lay.out_features for lay in layers[:-1]):  # (padding rows inside the fused one)
            return None
        if any(lay.act != first.act for lay in layers):  # one rounding per product
            return None
        fused = Int4Linear.__new__(Int4Linear)
        nn.Module.__init__(fused)
        fused.in_features, fused.source = first.in_features, "+".join(lay.source for lay in layers)
        fused.out_features = sum(lay.out_features for lay in layers)
        fused.kernel, fused.bits, fused.num_parts = first.kernel, first.bits, first.num_parts
        fused.symmetric = all(lay.symmetric for lay in layers)
        fused.activation_digits = first.activation_digits
        fused.numerics = getattr(first, "numerics", "genkit")
        fused._parts = []
        if first.kernel == "blocks":
            fused.register_buffer("blocks", torch.cat([lay.blocks for lay in layers]))
            return fused
        for i in range(first.num_parts):
            fused.register_buffer(f"packed{i}", torch.cat([getattr(lay, f"packed{i}") for lay in layers]))
            fused.register_buffer(f"scales{i}", torch.cat([getattr(lay, f"scales{i}") for lay in layers], dim=1))
        fused._parts = [(getattr(fused, f"packed{i}"), getattr(fused, f"scales{i}")) for i in range(first.num_parts)]
        return fused

    def extra_repr(self) -> str:
        detail = f"bits={self.bits}" if self.kernel == "blocks" else f"parts={self.num_parts}"
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}, {detail}"


class QuantizedEmbedding(QuantizedWeightModule):
    """An embedding table kept as int8 codes with one float scale per 32 values (GGUF ``Q8_0``);
    rows are de-quantized when looked up. ``weight`` (read-only): the whole table de-quantized, made
    on each read (:meth:`dequantized_weight`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # index_select and views: half the time of fancy indexing per decode step
        q = self.codes.index_select(0, flat).view(-1, self.embedding_dim // GROUP, GROUP).float()
        out = torch.mul(q, self.scales.index_select(0, flat).unsqueeze(-1))
        return out.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The ``(num_embeddings, embedding_dim)`` table in the embedding's dtype: codes times scales per
        32 values in float32 (as :meth:`forward` computes the rows it looks up)."""
        q = self.codes.view(self.num_embeddings, self.embedding_dim // GROUP, GROUP).float()
        return q.mul_(self.scales.unsqueeze(-1)).view(self.num_embeddings, self.embedding_dim).to(self.dtype)


# -- quantizing a float model --------------------------------------------------------------------------

def _float16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float16 stores them (as GGUF does; the block kernel keeps them so), in float32."""
    return scale.clamp(2.0 ** -24, 65504.0).to(torch.float16).float()


def _int4_symmetric(weight: torch.Tensor) -> Int4Part:
    """Round-to-nearest int4 per group of 32: ``w ~ scale * (q - 8)``, ``scale = max|w| / 7``."""
    out, k = weight.shape
    g = weight.detach().float().reshape(out, k // GROUP, GROUP)
    scale = _float16_scale(g.abs().amax(-1) / 7.0)
    q = torch.clamp(torch.round(g / scale[..., None]) + 8, 0, 15).to(torch.uint8).reshape(out, k)
    return Int4Part(q, scale, -8.0 * scale)


def _int8_symmetric(weight: torch.Tensor) -> list[Int4Part]:
    """Round-to-nearest int8 per group of 32 (``scale = max|w| / 127``), as two exact int4 halves."""
    out, k = weight.shape
    g = weight.detach().float().reshape(out, k // GROUP, GROUP)
    scale = _float16_scale(g.abs().amax(-1) / 127.0)
    q = torch.clamp(torch.round(g / scale[..., None]), -128, 127).to(torch.int16).reshape(out, k)
    lo, hi = q & 0x0F, q >> 4
    return [Int4Part(lo.to(torch.uint8), scale, torch.zeros_like(scale)),
            Int4Part((hi + 8).to(torch.uint8), 16.0 * scale, -128.0 * scale)]


QUANTIZE_MODES = ("int8", "int4")


def set_activation_digits(model: nn.Module, digits: int) -> nn.Module:
    """How the quantized layers of ``model`` round their activations on the block kernel; returns
    the model. ``2`` (the default): two int8 digits per value, so a quantized model gives its
    de-quantized float model's tokens; ``1``: one digit with llama.cpp's rounding (Q8_1 activations
    for weights with a free minimum, Q8_0 for symmetric ones), half the integer work and llama.cpp's
    tokens where float summation order allows (docs/models.md, "Activation rounding").

    A model without quantized layers, or one whose layers run on torch's int4 kernel (which rounds
    activations to bfloat16 instead), is refused."""
    digits = block_kernel.check_activation_digits(digits)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not layers:
        raise ConfigError("`activation_digits` applies to quantized models (a GGUF file kept quantized, or "
                          f"genkit.quantize); {type(model).__name__} has no quantized layers")
    if digits != 2 and any(lay.kernel != "blocks" for lay in layers):
        raise NotSupportedError(f"`activation_digits`={digits} needs the block kernel; these layers run on torch's "
                                "int4 kernel (no C compiler, or GENKIT_BLOCK_KERNEL=0)")
    for lay in layers:
        lay.activation_digits = digits
    model.activation_digits = digits  # type: ignore[assignment]
    model._prepared = None  # type: ignore[assignment]  # fused copies hold the old setting
    return model


LLAMA_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # GGUF block types whose llama.cpp dot products numerics="llama.cpp" follows


def set_numerics(model: nn.Module, numerics: str) -> nn.Module:
    """How a quantized GGUF model computes a step; returns the model. ``"genkit"`` (the default):
    genkit's own float operations. ``"llama.cpp"``: the float operations of llama.cpp's CPU backend
    with its defaults, op for op, so that greedy decoding gives llama.cpp's tokens: one activation
    digit (:func:`set_activation_digits`) with the products summed in ggml's order, its RMSNorm,
    rotary tables and rotation, float16 K/V cache and flash attention (float16 value accumulator),
    SwiGLU with ggml's vectorised exp. ggml sums the attention's dot products and computes exp in
    the order of the SIMD code it was built with: ``"llama.cpp"`` follows llama.cpp built for this
    CPU (:func:`genkit.models.numerics.native_llama_numerics`), ``"llama.cpp-avx2"``,
    ``"llama.cpp-avx512"`` and ``"llama.cpp-avx512-fp16"`` name the build; ``model.numerics`` says
    which one runs. Every step then runs on the block kernel's one-call decoder, a prompt one token
    at a time (docs/models.md, "llama.cpp numerics").

    Refused (NotSupportedError) for layers not on the block kernel, for GGUF types other than
    :data:`LLAMA_TYPES` (and for genkit.quantize's layers), for rope scaling, for Qwen2/Qwen3
    (their files keep q/k's rotary halves, whose ``q . k`` ggml sums in another order) and for GPT-2
    (not the Llama graph)."""
    numerics = check_numerics(numerics)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if is_llama_numerics(numerics):
        numerics = _check_llama_numerics(model, layers, numerics)
        set_activation_digits(model, 1)
    for lay in layers:
        lay.numerics = numerics
    from .llama import RMSNorm

    for module in model.modules():  # the final norm runs as its module
        if isinstance(module, RMSNorm):
            module.numerics = numerics
    model.numerics = numerics  # type: ignore[assignment]
    model._prepared = None  # type: ignore[assignment]  # the decoder's layer table holds the setting
    model._rope_cache = None  # type: ignore[assignment]
    return model


def _check_llama_numerics(model: nn.Module, layers: list[Int4Linear], numerics: str) -> str:
    """``numerics`` (a llama.cpp one) resolved to its build's (``"llama.cpp"``: this CPU's) if the model can
    follow it, else a ConfigError / NotSupportedError naming what stops it."""
    if not layers:
        raise ConfigError(f"`numerics`={numerics!r} applies to quantized GGUF models (kept quantized); "
                          f"{type(model).__name__} has no quantized layers")
    kinds = {part.split()[0] if " " in part else "genkit.quantize" for lay in layers for part in lay.source.split("+")}
    if kinds - set(LLAMA_TYPES):
        raise NotSupportedError(f"`numerics`={numerics!r} follows llama.cpp's dot products of {', '.join(LLAMA_TYPES)} "
                                f"weights; this model has {', '.join(sorted(kinds - set(LLAMA_TYPES)))}")
    from .gguf import GGUF_ARCHITECTURES

    config = getattr(model, "config", None)
    if config is not None and config.get("model_type") == "gpt2":
        raise NotSupportedError(f"`numerics`={numerics!r} follows llama.cpp's Llama-family graph (RMSNorm, rotary "
                                "positions, SwiGLU); this gpt2 model runs with numerics='genkit'")
    halves = {model_type for model_type, _, permuted in GGUF_ARCHITECTURES.values() if not permuted}
    if config is not None and config.get("model_type") in halves:
        raise NotSupportedError(f"`numerics`={numerics!r} sums the attention's q . k in the element order of "
                                "Llama's GGUF files (rotary pairs interleaved); llama.cpp sums a "
                                f"{config.get('model_type')} file's heads in their own order (rotary halves), "
                                "which the block kernel does not follow yet; this model runs with numerics='genkit'")
    if config is not None and (config.get("rope_scaling") or config.get("rope_parameters")):
        raise NotSupportedError(f"`numerics`={numerics!r} computes plain rotary tables; this model scales its rope")
    return native_llama_numerics() if numerics == "llama.cpp" else numerics


def quantize(model: nn.Module, mode: str = "int8", activation_digits: int = 2) -> nn.Module:
    """Quantize the linear layers of a native genkit model in place (weight-only) and return it.

    ``mode``: ``"int8"`` (8-bit codes, one scale per 32 weights; near-lossless) or ``"int4"``
    (4-bit, one scale per 32; about 4x less memory than bfloat16, with a measurable loss). The
    decoder layers' q/k/v/o and MLP projections (GPT-2's ``Conv1D`` layers too, whose weights are
    stored ``(in, out)``: they become int4 layers with their float bias, as a quantized GPT-2 GGUF
    file loads) and the LM head are quantized; embeddings and norms stay as they are. Layers whose
    sizes the kernel cannot take (inputs not a multiple of 32; on torch's int4 kernel, without the
    block kernel, also output rows not a multiple of 16: GPT-2's 50,257-row head) are left in
    floating point, with a log line.
    ``activation_digits``: see :func:`set_activation_digits` (the weights are symmetric, so 1 is
    llama.cpp's Q8_0 rounding).
    """
    if mode not in QUANTIZE_MODES:
        raise ConfigError(f"`mode` must be one of {', '.join(repr(m) for m in QUANTIZE_MODES)}; got {mode!r}")
    block_kernel.check_activation_digits(activation_digits)
    if not kernel_available() and not block_kernel.available():
        raise KernelUnavailableError("quantize needs the block kernel (a C compiler) or a torch build with CPU int4 kernels")
    from .base import GenkitModel
    from .gpt2 import Conv1D

    if not isinstance(model, GenkitModel):
        raise ArgumentTypeError(f"quantize takes a native genkit model (genkit.load_model); got {type(model).__name__}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise NotSupportedError("quantize runs on CPU models; the int4 kernels are CPU kernels")
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) in (nn.Linear, Conv1D)]
    skipped = []
    with torch.no_grad():
        for name, lin in targets:
            weight = lin.weight.t() if type(lin) is Conv1D else lin.weight  # (out, in) rows
            out, k = weight.shape
            if not int4_shape_ok(out, k, padded=block_kernel.available()):
                skipped.append(name)
                continue
            parts = [_int4_symmetric(weight)] if mode == "int4" else _int8_symmetric(weight)
            layer: nn.Module = Int4Linear(k, out, parts, source=name)
            if lin.bias is not None:
                layer = WithBias(layer, lin.bias.detach().clone())
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, layer)
    if skipped:
        logger.info("quantize: %d linear layers left in floating point (sizes): %s", len(skipped), skipped[:4])
    model._prepared = None  # type: ignore[attr-defined]
    model.quantization = mode  # type: ignore[attr-defined]
    return set_activation_digits(model, activation_digits) if activation_digits != 2 else model


class WithBias(QuantizedWeightModule):
    """An int4 layer plus a float bias; ``weight`` (read-only) is its int4 layer's."""

    def __init__(self, inner: Int4Linear, bias: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return self.inner.dequantized_weight()
