"""genkit's own float32 matrix-vector product (``dense_kernel.c``): the ``"gemv"`` path of the
per-CPU kernel choice (:mod:`genkit.models.kernel_choice`) for batch-1 decode and products of a
few rows.

A decode step reads every weight once per token, so its products are bound by memory bandwidth,
and torch's linear over one row runs on one thread (a 49152x576 float32 LM head: 15.4 ms at 1
thread, 18.0 ms at 2 on a 2-core EPYC). This kernel shares each product among torch's threads
(OpenMP, the runtime torch loaded), with vector code for the CPU it is built on (``-march=native``:
AVX-512, AVX2/FMA, or the compiler's portable vectors), on the weight as genkit stores it: no copy,
no repacking, so it costs no memory. Column-major weights (genkit's CPU layout,
:func:`genkit.models.llama_infer.lay_out`) and row-major ones (``nn.Linear``'s own) both run on it;
on column-major ones one core reads the weights about as fast as a sequential read loop (one row of
x: four weight streams at once, each a long sequential read of a quarter of the rows).
:meth:`Gemv.fused` also runs a decoder layer's work around a product in the same call: the RMSNorm
or the MLP's gate (``silu(gate) * up``) before it, the residual add after it.

It is built and cached like the block kernel, with the same compiler, flags, verified cache and
switch (:func:`genkit.models.block_kernel.build_cached`; ``GENKIT_BLOCK_KERNEL=0`` turns both
off, ``portable`` builds both without CPU-specific flags): without a C compiler the ``"gemv"`` path
does not exist here, and ``GENKIT_KERNEL=decode:gemv`` is refused by name.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import KernelUnavailableError
from . import block_kernel

logger = logging.getLogger("genkit.models")

SOURCE = Path(__file__).with_name("dense_kernel.c")
# products over more rows run on torch's linear. A laid-out (column-major) weight: up to the C kernel's
# EXACT_ROWS (16) it reads each weight vector once for all rows (0.51-0.61x torch's time at 5-16 rows of
# SmolLM2's layer products on the Xeon guest, 0.60-0.77x on its AVX2 build; session 36), beyond it RT rows
# per pass (1.0-2.4x torch's time from 17 rows). A row-major one (a tied LM head) takes 4 rows at a time:
# 0.57-0.89x torch's time at 4-8 rows, 0.96-1.39x at 16
MAX_ROWS = 16
MAX_ROWS_ROW_MAJOR = 8
PRE_NONE, PRE_RMS, PRE_GATE = 0, 1, 2  # what Gemv.fused does to x first (the C kernel's GK_PRE_*)

_libs: dict[tuple[str | None, str | None], Any] = {}  # per (build mode, compiler): the library or None


def _declare(lib: Any) -> Any:
    args = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int]
    for fn in (lib.gk_gemv_t, lib.gk_gemv_n):
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.gk_gemv_pre.argtypes = [ctypes.c_int, *args, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    lib.gk_gemv_pre.restype = ctypes.c_int
    lib.gk_gemv_t_cols.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.gk_gemv_t_cols.restype = ctypes.c_int
    return lib


def library() -> Any:
    """The loaded kernel, or None where it cannot be had (no C compiler, ``GENKIT_BLOCK_KERNEL=0``,
    a failed build: logged)."""
    mode = block_kernel.build_mode()
    cc = block_kernel._compiler() if mode is not None else None
    key = (mode, cc)
    if key not in _libs:
        lib = None
        if mode is None:
            logger.info("the dense kernel is switched off by %s", block_kernel.ENV_SWITCH)
        elif cc is None:
            logger.info("no C compiler found (CC=%s): no gemv path", os.environ.get("CC", ""))
        else:
            try:
                lib = _declare(block_kernel.build_cached(cc, mode, SOURCE, "genkit_dense"))
            except (OSError, RuntimeError) as exc:
                logger.warning("the dense kernel is unavailable: %s", exc)
        _libs[key] = lib
    return _libs[key]


def available() -> bool:
    """Whether the kernel is built and loaded here (see the module docstring)."""
    return library() is not None


class Gemv:
    """An ``(out, in)`` float32 CPU weight whose products over at most MAX_ROWS rows (MAX_ROWS_ROW_MAJOR for
    a row-major weight) run on the kernel (more rows, or another dtype of input: torch's linear on the
    same weight). Holds the weight itself, never a copy."""

    __slots__ = ("column_major", "fn", "ld", "pre", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        lib = library()
        if lib is None:
            raise KernelUnavailableError("the dense kernel (gemv) is not available here")
        n, k = weight.shape
        self.weight = weight
        self.fn, self.ld, self.pre, self.column_major = None, 0, lib.gk_gemv_pre, True
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and n > 1 and k > 1:
            if weight.stride(0) == 1 and weight.stride(1) >= n:
                self.fn, self.ld = lib.gk_gemv_t, weight.stride(1)
            elif weight.stride(1) == 1 and weight.stride(0) >= k:
                self.fn, self.ld, self.column_major = lib.gk_gemv_n, weight.stride(0), False

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def _rows(self, x: torch.Tensor, width: int) -> int:
        """The rows of ``x`` (..., width) when the kernel takes them, else 0."""
        rows = x.numel() // width if width else 0
        most = MAX_ROWS if self.column_major else MAX_ROWS_ROW_MAJOR
        if self.fn is None or not 0 < rows <= most or x.dtype != torch.float32 or x.requires_grad:
            return 0
        return rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x (..., in) @ weight^T (+ bias)``."""
        n, k = self.weight.shape
        rows = self._rows(x, k)
        if not rows:
            return F.linear(x, self.weight, bias)
        x2 = x.reshape(rows, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        if self.fn(x2.data_ptr(), x2.stride(0), self.weight.data_ptr(), self.ld, y.data_ptr(), rows, n, k,
                   torch.get_num_threads()):
            raise MemoryError("the dense kernel could not allocate its scratch memory")
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], n)

    def fused(self, x: torch.Tensor, pre: int, norm: torch.Tensor | None = None, eps: float = 0.0,
              residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """``residual + pre(x) @ weight^T`` in one kernel call, with ``pre`` one of PRE_NONE, PRE_RMS
        (RMSNorm of each row with weight ``norm`` and ``eps``) or PRE_GATE (``x`` is ``(gate, up)``
        halves: ``silu(gate) * up``); None when the kernel does not take this call (too many rows,
        another dtype, strided rows or residual): the caller then computes it with torch."""
        n, k = self.weight.shape
        width = 2 * k if pre == PRE_GATE else k
        rows = self._rows(x, width)
        if not rows or x.shape[-1] != width or not x.is_contiguous():
            return None
        if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                     or residual.numel() != rows * n):
            return None
        if norm is not None and (norm.dtype != torch.float32 or not norm.is_contiguous()):
            return None
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        if self.pre(self.column_major, x.data_ptr(), x.shape[-1], self.weight.data_ptr(), self.ld, y.data_ptr(), rows,
                    n, k, torch.get_num_threads(), pre, 0 if norm is None else norm.data_ptr(), eps,
                    0 if residual is None else residual.data_ptr()):
            raise MemoryError("the dense kernel could not allocate its scratch memory")
        return y
