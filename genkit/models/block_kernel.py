"""The block kernel: a small C library (``block_kernel.c``) for products with weights kept in
GGUF-style blocks of 32, built on first use by the machine's C compiler and loaded with ctypes.

It is built with ``-march=native``: on a CPU with AVX-512 VNNI the dot products are one
instruction per 64 weights (as in llama.cpp); with AVX2 (and FMA, F16C) they go through
``vpmaddubsw``/``vpmaddwd``, with the same exact integer sums. The library is cached under
``$GENKIT_HOME/kernels/`` (default ``~/.cache/genkit``), keyed by the source, the compiler and the
CPU, and checked before it is loaded (owner, mode, no symlink, the sha256 recorded at build; see
:mod:`genkit.models.kernel_cache`). Without a compiler, on a CPU with neither, or with
``GENKIT_BLOCK_KERNEL=0``, quantized layers use torch's int4 kernels instead;
``GENKIT_BLOCK_KERNEL=portable`` forces the portable C loops (slow; for tests and odd CPUs) and
``GENKIT_BLOCK_KERNEL=avx2`` the AVX2 build on a CPU that also has AVX-512.

The product it computes: each group of 32 weights of an output row is ``d * u + m`` (codes ``u``
of 4 or 8 bits, float16 ``d`` and ``m``) and activations are rounded to int8 per block of 32
(``x ~ dx * qx``), so ``y = sum(d * dx * (u . qx) + m * dx * sum(qx))``. How activations are
rounded is the ``act`` argument (:data:`ACT_TWO`, the default: two int8 digits per value, as exact
as the float16 scales; :data:`ACT_Q8_1` / :data:`ACT_Q8_0`: llama.cpp's one digit, see
:func:`act_mode`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, KernelUnavailableError
from . import kernel_cache
from .cpu import cache_key, cpu_info, kernel_flags

logger = logging.getLogger("genkit.models")

ROWS = 16  # rows per panel
GROUP = 32  # weights per block
SOURCE = Path(__file__).with_name("block_kernel.c")
ENV_SWITCH = "GENKIT_BLOCK_KERNEL"

_lib: Any = None
_tried = False


BLOCK_BYTES = {4: 320, 8: 576, 6: 640}  # codes of 16 rows x 32 weights, then their scales


def block_bytes(bits: int) -> int:
    """Bytes per panel-block (16 rows x 32 weights, with their scales): ``bits`` 4 and 8 have one
    scale and offset per 32 weights, 6 (GGUF Q6_K, codes 0-63 in bytes) one per 16."""
    return BLOCK_BYTES[bits]


def _compiler() -> str | None:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    exe = shutil.which(str(cc).split()[0])
    return exe


def _cache_dir() -> Path:
    from .demo import genkit_home

    return Path(genkit_home()) / "kernels"


BUILD_FLAGS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"],
               "avx-vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], "portable": []}
SIMD_NAMES = {2: "avx512-vnni", 3: "avx-vnni", 1: "avx2", 0: ""}
SETTINGS = ("0", "1", "portable", "avx2", "avx-vnni")
FORCED = ("portable", "avx2", "avx-vnni")  # the settings that name a build; the rest are on/off


def _flags(mode: str) -> list[str]:
    return ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall", *BUILD_FLAGS[mode]]


def cache_name(cc: str, mode: str = "native", source: Path = SOURCE, stem: str = "genkit_blocks") -> str:
    """The library's file name in the cache: a hash of the C source, the compiler (its path and
    ``--version``), the CPU and the flags, so any change builds a new library."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join(part.encode() if isinstance(part, str) else part for part in (
        source.read_bytes(), cc, version, cache_key(), " ".join(_flags(mode))))).hexdigest()[:16]
    return f"{stem}-{key}.so"


def build_cached(cc: str, mode: str = "native", source: Path = SOURCE, stem: str = "genkit_blocks") -> Any:
    """The C library ``source`` built by ``cc`` with the ``mode``'s flags (:data:`BUILD_FLAGS`) and
    loaded from the verified cache (:mod:`genkit.models.kernel_cache`); the block kernel and
    :mod:`genkit.models.dense_kernel` share it. Raises ``RuntimeError``/``OSError`` on failure."""
    def build(out: Path) -> None:
        proc = subprocess.run([cc, *_flags(mode), str(source), "-o", str(out), "-lm"], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            raise KernelUnavailableError(f"building {source.name} with {cc} failed:\n{proc.stderr[-2000:]}")

    return kernel_cache.load(_cache_dir(), cache_name(cc, mode, source, stem), build)


def build_mode() -> str | None:
    """The build :data:`ENV_SWITCH` asks for (``"native"``, ``"portable"``, ``"avx2"``, ``"avx-vnni"``),
    or None when it switches the C kernels off; ConfigError for a value not in :data:`SETTINGS`, and
    for ``"avx-vnni"`` on a CPU without AVX-VNNI (its build would stop on an illegal instruction)."""
    setting = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return None
    if setting not in ("", "1", "true", "yes", "on", *FORCED):
        raise ConfigError(f"{ENV_SWITCH} must be one of {', '.join(repr(v) for v in SETTINGS)}; got {setting!r}")
    if setting == "avx-vnni" and "avx_vnni" not in kernel_flags():
        raise ConfigError(f"{ENV_SWITCH}=avx-vnni needs a CPU with AVX-VNNI; this one has "
                          f"{' '.join(kernel_flags()) or 'none of the kernel flags'} (use 1, avx2 or portable)")
    return setting if setting in FORCED else "native"


ACT_TWO, ACT_Q8_1, ACT_Q8_0 = 0, 1, 2  # the C kernel's GK_ACT_* (how activations are rounded)
ACT_LLAMA_Q8_1, ACT_LLAMA_Q8_0 = 3, 4  # the one-digit roundings with llama.cpp's float order (numerics="llama.cpp")
ACTIVATION_DIGITS = (1, 2)


def act_mode(digits: int, symmetric: bool) -> int:
    """The kernel's activation rounding for ``digits`` int8 digits per value: 2 is :data:`ACT_TWO`;
    1 is llama.cpp's rounding, :data:`ACT_Q8_0` for symmetric weights (``m = -2**(bits-1) * d``:
    GGUF Q4_0, Q8_0, Q6_K, ``genkit.quantize``; llama.cpp pairs them with Q8_0 activations) and
    :data:`ACT_Q8_1` for weights with a free minimum (Q4_1, Q4_K: Q8_1 activations)."""
    return ACT_TWO if check_activation_digits(digits) == 2 else (ACT_Q8_0 if symmetric else ACT_Q8_1)


def llama_order(act: int) -> int:
    """The one-digit ``act`` (:data:`ACT_Q8_1`, :data:`ACT_Q8_0`) with its products summed in
    llama.cpp's float order (the C kernel's ``panel_llama``); ConfigError for :data:`ACT_TWO`."""
    if act not in (ACT_Q8_1, ACT_Q8_0):
        raise ConfigError("llama.cpp's float order applies to one activation digit (`activation_digits`=1)")
    return act + 2


def cpu_flags() -> set[str]:
    """The first CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    return set(cpu_info().flags)


def rope_table_llama(base: float, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables (``(positions, head_dim)`` float32, genkit's halves layout) built as
    llama.cpp builds its rotary angles: ``powf(base, -2/dims)`` multiplied in pair after pair, cosf/sinf."""
    cos = torch.empty(positions, head_dim, dtype=torch.float32)
    sin = torch.empty(positions, head_dim, dtype=torch.float32)
    library().gk_rope_table_llama(float(base), head_dim, 0, positions, cos.data_ptr(), sin.data_ptr())
    return cos, sin


def rms_norm_llama(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension as ggml computes it (double sum, float32 mean, ``x * scale * w``)."""
    flat = x.float().reshape(-1, x.shape[-1]).contiguous()
    w = weight.detach().float().contiguous()
    out = torch.empty_like(flat)
    library().gk_rms_norm_llama(flat.data_ptr(), w.data_ptr(), float(eps), flat.shape[0], flat.shape[1], out.data_ptr())
    return out.view(x.shape).to(x.dtype)


def check_activation_digits(digits: Any) -> int:
    """``digits`` if it is an accepted ``activation_digits`` (1 or 2), else a ConfigError."""
    if not isinstance(digits, int) or isinstance(digits, bool) or digits not in ACTIVATION_DIGITS:
        raise ConfigError(f"`activation_digits` must be one of {', '.join(map(str, ACTIVATION_DIGITS))}; "
                          f"got {digits!r}")
    return int(digits)


def declare(lib: Any) -> None:
    """The C signatures of the kernel's entry points on a loaded library (``ctypes.CDLL``)."""
    lib.gk_simd.restype = ctypes.c_int
    lib.gk_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gk_matmul.restype = ctypes.c_int
    lib.gk_decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gk_decode.restype = ctypes.c_int
    lib.gk_decode_paged.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gk_decode_paged.restype = ctypes.c_int
    lib.gk_attend_paged.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.gk_attend_paged.restype = ctypes.c_int
    lib.gk_decode_logits.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.gk_decode_logits.restype = ctypes.c_int
    lib.gk_logits.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.gk_logits.restype = ctypes.c_int
    lib.gk_argmax.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.gk_argmax.restype = ctypes.c_int
    lib.gk_decode_top.argtypes = [*lib.gk_decode_logits.argtypes, ctypes.c_int, ctypes.c_void_p]
    lib.gk_decode_top.restype = ctypes.c_int
    lib.gk_decode_verify.argtypes = [*lib.gk_decode_logits.argtypes[:-1], ctypes.c_void_p, ctypes.c_void_p]
    lib.gk_decode_verify.restype = ctypes.c_int
    lib.gk_head_proxy.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int]
    lib.gk_head_proxy.restype = ctypes.c_int
    lib.gk_pack_gguf.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.gk_pack_gguf.restype = ctypes.c_int
    lib.gk_rope_table_llama.argtypes = [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_void_p]
    lib.gk_rope_table_llama.restype = None
    lib.gk_rms_norm_llama.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_void_p]
    lib.gk_rms_norm_llama.restype = None
    lib.gk_swiglu_llama.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gk_swiglu_llama.restype = None
    lib.gk_fma_f16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.gk_fma_f16.restype = None
    lib.gk_amx_init.restype = ctypes.c_int


def library() -> Any:
    """The loaded kernel library, or None when it cannot be had (no compiler, switched off)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    mode = build_mode()
    if mode is None:
        logger.info("block kernel switched off by %s", ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found; quantized layers use torch's int4 kernels")
        return None
    try:
        lib = build_cached(cc, mode)
    except (OSError, RuntimeError) as exc:
        logger.warning("block kernel unavailable, quantized layers use torch's int4 kernels: %s", exc)
        return None
    declare(lib)
    if mode == "native" and lib.gk_simd() == 0:
        logger.info("the CPU has neither AVX-512 VNNI nor AVX2: quantized layers use torch's int4 kernels "
                    "(%s=portable forces the slow portable loops)", ENV_SWITCH)
        return None
    global _amx
    _amx = mode == "native" and bool(lib.gk_amx_init())
    _lib = lib
    return lib


_amx = False


def amx_available() -> bool:
    """Whether products of many rows can run on AMX int8 tiles here: the kernel was built with its
    AMX path (``-march=native`` on a CPU with AMX-INT8), the CPU says so (CPUID) and Linux granted
    this process the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``)."""
    library()
    return _amx


# Where the probe picks AMX for the prefill class (probed at 64 rows), products from this many rows
# take it: the tile path's fixed costs per call (each 16 rows' A tiles laid out, each panel's 4-bit
# codes unpacked into B tiles, a second parallel region for the rows after the last 16) made it 1.0-1.2x
# slower than VNNI at 17-24 rows at 2 threads on a Xeon with AMX (faster from 16 rows at 1 thread),
# 1.3-1.5x faster from 31 rows (docs/benchmarks.md, session 25).
AMX_PREFILL_MIN_ROWS = 32


def available() -> bool:
    """Whether the block kernel is built and loaded (see the module docstring)."""
    return library() is not None


def simd() -> str:
    """The loaded kernel's vector path: ``"avx512-vnni"``, ``"avx-vnni"`` (AVX2 with 256-bit VNNI),
    ``"avx2"``, or ``""`` (the portable loops, or no kernel)."""
    lib = library()
    return SIMD_NAMES[int(lib.gk_simd())] if lib is not None else ""


def pack(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """Weights ``scale * codes + minimum`` (per group of 32 along the input, 16 for ``bits=6``) in
    the kernel's layout: ``(rows / 16, in / 32, block_bytes(bits))`` uint8. ``codes``: ``(rows, in)``
    in ``[0, 2**bits)``; ``scale``/``minimum``: ``(rows, in / group)``, stored as float16."""
    rows, k = codes.shape
    panels, nb = rows // ROWS, k // GROUP
    u = codes.to(torch.uint8)
    if bits == 4:
        # k = 32 b + 8 c + 4 h + j -> byte (c, r, j): low nibble h = 0, high nibble h = 1
        g = u.reshape(panels, ROWS, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)
        body = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).reshape(panels, nb, 256)
    elif bits in (6, 8):
        body = u.reshape(panels, ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(panels, nb, 512)
    else:
        raise ConfigError(f"`bits` must be 4, 6 or 8; got {bits}")
    if bits == 6:  # float32 scales per 16 weights (first halves, then second halves); offsets are -32 d
        d = scale.float().reshape(panels, ROWS, nb, 2).permute(0, 2, 3, 1).contiguous()
        return torch.cat([body, d.view(torch.uint8).reshape(panels, nb, 128)], dim=-1).contiguous()

    def half(t: torch.Tensor) -> torch.Tensor:
        h = t.float().reshape(panels, ROWS, nb).permute(0, 2, 1).to(torch.float16).contiguous()
        return h.view(torch.uint8).reshape(panels, nb, 2 * ROWS)

    return torch.cat([body, half(scale), half(minimum)], dim=-1).contiguous()


def unpack(blocks: torch.Tensor, bits: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`: ``(codes, scale, minimum)`` of the first ``rows`` rows of
    ``blocks`` (``(panels, in / 32, block_bytes(bits))`` uint8; rows past ``rows``, a last panel's
    padding, left out). ``codes``: ``(rows, in)`` uint8; ``scale``/``minimum``: ``(rows, in / group)``
    float32 (groups of 32, 16 for ``bits=6``), the float16 values stored (float32 for ``bits=6``,
    whose minimum is ``-32 * scale``), so that ``pack(*unpack(b, bits, panels * 16), bits)`` gives
    ``b`` byte for byte."""
    if bits not in BLOCK_BYTES:
        raise ConfigError(f"`bits` must be 4, 6 or 8; got {bits}")
    panels, nb, nbytes = blocks.shape
    if nbytes != BLOCK_BYTES[bits] or not 0 <= rows <= panels * ROWS:
        raise ConfigError(f"blocks of shape {tuple(blocks.shape)} do not hold {rows} rows of {bits}-bit codes")
    b = blocks.contiguous()
    if bits == 4:  # byte (c, r, j): low nibble weight 32 b + 8 c + j, high nibble + 4
        body = b[..., :256].reshape(panels, nb, 4, ROWS, 4)
        g = torch.stack([body & 0x0F, body >> 4], dim=3)  # (panels, nb, c, h, r, j)
        codes = g.permute(0, 4, 1, 2, 3, 5).reshape(panels * ROWS, nb * GROUP)
    else:
        codes = b[..., :512].reshape(panels, nb, 8, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(panels * ROWS, nb * GROUP)
    if bits == 6:
        d = b[..., 512:].contiguous().view(torch.float32).reshape(panels, nb, 2, ROWS)
        scale = d.permute(0, 3, 1, 2).reshape(panels * ROWS, nb * 2)
        return codes[:rows].contiguous(), scale[:rows].contiguous(), -32.0 * scale[:rows]

    def half(at: int) -> torch.Tensor:
        h = b[..., at:at + 2 * ROWS].contiguous().view(torch.float16).reshape(panels, nb, ROWS)
        return h.permute(0, 2, 1).reshape(panels * ROWS, nb)[:rows].float()

    body_bytes = BLOCK_BYTES[bits] - 4 * ROWS
    return codes[:rows].contiguous(), half(body_bytes), half(body_bytes + 2 * ROWS)


def fits_float16(*tensors: torch.Tensor) -> bool:
    """Whether scales/offsets survive float16 storage (finite, no overflow)."""
    return all(bool(torch.isfinite(t.float().to(torch.float16)).all()) for t in tensors)


def matmul(x: torch.Tensor, blocks: torch.Tensor, bits: int, out_features: int, act: int = ACT_TWO,
           amx_rows: int = 0) -> torch.Tensor:
    """``x (M, K) @ W^T`` for ``W`` packed by :func:`pack`; float32 in and out; ``act``: how the
    activations are rounded (:func:`act_mode`); ``amx_rows``: products of at least this many rows (and
    at least 16: fewer fill no tile group) run on AMX tiles where :func:`amx_available`, with the same
    bits (0: never; a model's is its kernel choice's, ``Int4Linear.amx_rows``)."""
    fn = _lib.gk_matmul if _lib is not None else library().gk_matmul
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.float32)
    rc = fn(bits, blocks.data_ptr(), x.data_ptr(), y.data_ptr(), m, out_features, k, torch.get_num_threads(),
            act, amx_rows) if m else 0
    if rc == -3:
        raise ConfigError(f"`bits` must be 4, 6 or 8; got {bits}")
    if rc == -4:
        raise ConfigError(f"`act` must be one of {ACT_TWO}-{ACT_LLAMA_Q8_0} ({ACT_LLAMA_Q8_1} and {ACT_LLAMA_Q8_0} not "
                          f"for 6-bit weights); got {act} for {bits}-bit weights")
    if rc:
        raise MemoryError("the block kernel could not allocate its scratch memory")
    return y


def attends(head_dim: int) -> bool:
    """Whether the kernel is here and its attention takes heads of ``head_dim`` (even, at most 512)."""
    return head_dim % 2 == 0 and 0 < head_dim <= 512 and available()


def attend_paged(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, block_size: int, scale: float | None = None) -> torch.Tensor:
    """Attention of ``q`` ``(rows, heads, head_dim)`` (float32, rotary embedding applied), row ``r`` at
    position ``positions[r]`` over its positions ``0..positions[r]`` in the blocks ``table[r]`` of one
    layer of the paged store (``keys``/``values``: ``(num_blocks, kv_heads, block_size, head_dim)``,
    float32, contiguous; grouped heads when ``heads > kv_heads``), the scores times ``scale`` (None:
    ``1 / sqrt(head_dim)``); returns ``(rows, heads, head_dim)``.
    The kernel reads the blocks where they are (no gathered copy) and attends as its one-call
    paged step does."""
    rows, nq, d = q.shape
    nkv = keys.shape[1]
    q = q.contiguous()
    table = table.to(torch.int32).contiguous()
    pos = positions.to(torch.int32).contiguous()
    span = int(pos.max()) + 1
    scratch = torch.empty(rows * ((nq + 2 * nkv) * d + nq * span), dtype=torch.float32)
    out = torch.empty(rows, nq, d, dtype=torch.float32)
    rc = library().gk_attend_paged(q.data_ptr(), rows, nq, nkv, d, pos.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                   table.data_ptr(), table.shape[1], block_size, float(scale or 0.0),
                                   scratch.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if rc:
        raise ConfigError(f"attention over the paged store takes heads a multiple of kv_heads and an even head_dim "
                          f"<= 512 (`attends`); got heads={nq}, kv_heads={nkv}, head_dim={d}")
    return out


def head_proxy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The 8-bit copy of a float32 LM head ``weight`` ``(N, K)`` stored column-major (stride ``(1,
    ld)``) that greedy decode steps read instead of it (``gk_head_proxy`` in block_kernel.c): its
    blocks (bits 8, ``N`` rounded up to a multiple of :data:`ROWS`) and per row the bound of the
    distance between its logit and the exact one, per unit of the hidden state's norm. None where
    it cannot be made (``K`` not a multiple of :data:`GROUP`, a weight not finite, a scale too large
    for float16)."""
    n, k = weight.shape
    if (weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.stride(0) != 1 or k % GROUP
            or weight.stride(1) < n):
        return None
    panels = (n + ROWS - 1) // ROWS
    blocks = torch.empty(panels, k // GROUP, BLOCK_BYTES[8], dtype=torch.uint8)
    bound = torch.empty(n, dtype=torch.float32)
    rc = library().gk_head_proxy(weight.data_ptr(), weight.stride(1), n, k, blocks.data_ptr(), bound.data_ptr(),
                                 torch.get_num_threads())
    return (blocks, bound) if rc == 0 else None
