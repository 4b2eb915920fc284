"""GGUF quantized blocks decoded into int4 parts (:class:`genkit.models.quant.Int4Part`) without
de-quantizing: the codes stay 4-bit, with one float scale and offset per group of 32 weights.
Checked against the ``gguf`` package's own de-quantization in tests/test_quantized.py.

Where the block kernel runs, :func:`block_layer` converts a tensor's blocks straight into its layout
in one C call (``gk_pack_gguf``: the bytes :func:`genkit.models.block_kernel.pack` makes of the int4
parts, without the parts)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from ..errors import ModelFileError, UnsupportedModelError
from . import block_kernel
from .quant import GROUP, Int4Linear, Int4Part, QuantizedEmbedding


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: the low nibbles are weights 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    d = _f16(blocks[..., 0:2])
    return [(_nibbles(blocks[..., 2:18]), d, -8.0 * d)]


def _q4_1(blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(_nibbles(blocks[..., 4:20]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]))]


def _q8_0(blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)
    lo = q.view(np.uint8) & 0x0F
    hi = (q >> 4) + np.int8(8)  # q = 16 * (hi - 8) + lo, hi - 8 in [-8, 7]
    return [(lo, d, np.zeros_like(d)), (hi.view(np.uint8), 16.0 * d, -128.0 * d)]


def _q4_k(blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """256-weight super-blocks: float16 ``d`` and ``dmin``, 8 six-bit (scale, min) pairs, 128 bytes
    of codes; sub-block ``j``'s weights are ``d * sc_j * q - dmin * m_j``."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.int32)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 8, 32)
    scale = d[..., None] * sc
    minimum = -dmin[..., None] * mn
    n = blocks.shape[:-1]
    return [(codes.reshape(*n[:-1], n[-1] * 8, 32), scale.reshape(*n[:-1], -1), minimum.reshape(*n[:-1], -1))]


def _q6_k(blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """256-weight super-blocks: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, a
    float16 ``d``; sub-block ``j`` (16 weights) is ``d * sc_j * (q - 32)`` with 6-bit ``q``. Codes
    in groups of 16 (the block kernel's 6-bit format)."""
    n = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*n, 2, 64).astype(np.uint8)
    qh = blocks[..., 128:192].reshape(*n, 2, 32).astype(np.uint8)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    codes = np.empty((*n, 2, 4, 32), dtype=np.uint8)  # per 128-weight half: 4 runs of 32
    for k in range(4):
        low = ql[..., 32 * (k % 2):32 * (k % 2) + 32]
        low = (low & 0x0F) if k < 2 else (low >> 4)
        codes[..., k, :] = low | (((qh >> (2 * k)) & 3) << 4)
    scale = d[..., None] * sc
    return [(codes.reshape(*n[:-1], n[-1] * 16, 16), scale.reshape(*n[:-1], -1),
             (-32.0 * scale).reshape(*n[:-1], -1))]


# GGUF type name -> (weights per block, bytes per block, decoder into int4 parts)
GGUF_INT4_TYPES: dict[str, tuple[int, int, Any]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (256, 144, _q4_k),
}
# ... and those only genkit's block kernel runs (6-bit codes in groups of 16)
GGUF_BLOCK_TYPES: dict[str, tuple[int, int, Any]] = {**GGUF_INT4_TYPES, "Q6_K": (256, 210, _q6_k)}


_C_INT_MAX = 2**31 - 1
# GGUF type name -> gk_pack_gguf's number for it, and the bits of the kernel's codes
GGUF_PACK: dict[str, tuple[int, int]] = {"Q4_0": (0, 4), "Q4_1": (1, 4), "Q8_0": (2, 8), "Q4_K": (3, 4), "Q6_K": (4, 6)}


def block_layer(type_name: str, data: np.ndarray, shape: tuple[int, int], source: str = "") -> Int4Linear:
    """A block-kernel layer of the GGUF tensor of ``type_name`` with torch shape ``(out, in)``, its raw
    blocks ``data`` converted into the kernel's layout in one C call (no int4 parts, no float copy).
    ModelFileError where ``data`` does not hold those blocks; UnsupportedModelError where a scale leaves
    float16's range (as :class:`Int4Linear` says for the parts)."""
    number, bits = GGUF_PACK[type_name]
    per_block, nbytes, _ = GGUF_BLOCK_TYPES[type_name]
    out, k = shape
    raw = np.asarray(data, dtype=np.uint8)
    if out <= 0 or k <= 0 or k % per_block or raw.nbytes != out * (k // per_block) * nbytes:
        raise ModelFileError(f"{source or type_name}: {raw.nbytes} bytes do not hold a ({out}, {k}) {type_name} "
                             f"tensor (blocks of {per_block} weights in {nbytes} bytes)")
    if max(out, k) > _C_INT_MAX:  # (ctypes would wrap the C int around)
        raise UnsupportedModelError(f"{source or type_name}: a ({out}, {k}) tensor; the block kernel takes at most "
                                    f"{_C_INT_MAX} rows and columns")
    raw = np.ascontiguousarray(raw)
    panels = -(-out // block_kernel.ROWS)
    blocks = torch.empty(panels, k // GROUP, block_kernel.block_bytes(bits), dtype=torch.uint8)
    symmetric = ctypes.c_int(0)
    rc = block_kernel.library().gk_pack_gguf(number, raw.ctypes.data, out, k, blocks.data_ptr(),
                                             ctypes.byref(symmetric), torch.get_num_threads())
    if rc == -6:
        raise UnsupportedModelError(f"{source or 'int4 layer'}: scales overflow float16, which the block kernel "
                                    "stores; set GENKIT_BLOCK_KERNEL=0 to use torch's int4 kernel")
    if rc:
        raise ModelFileError(f"{source or type_name}: the block kernel cannot convert {type_name} blocks (code {rc})")
    return Int4Linear.from_blocks(blocks, k, out, bits, bool(symmetric.value), source)


def int4_parts_from_gguf(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> list[Int4Part]:
    """The int4 parts of a GGUF tensor of ``type_name`` with torch shape ``(out, in)``, from its raw
    blocks ``data`` (uint8, as the gguf reader exposes them)."""
    per_block, nbytes, decode = GGUF_BLOCK_TYPES[type_name]
    out, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(out, k // per_block, nbytes)
    parts = []
    for q, scale, minimum in decode(blocks):
        group = (out * k) // scale.size
        parts.append(Int4Part(torch.from_numpy(np.ascontiguousarray(q.reshape(out, k))),
                              torch.from_numpy(np.ascontiguousarray(scale.reshape(out, k // group))),
                              torch.from_numpy(np.ascontiguousarray(minimum.reshape(out, k // group))), group))
    return parts


def q8_0_embedding(data: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> QuantizedEmbedding:
    """An embedding table from GGUF ``Q8_0`` blocks, kept as int8 codes and scales."""
    rows, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, k // GROUP, 34)
    codes = blocks[..., 2:34].view(np.int8).reshape(rows, k)
    return QuantizedEmbedding(torch.from_numpy(np.ascontiguousarray(codes)),
                              torch.from_numpy(_f16(blocks[..., 0:2])), dtype)
