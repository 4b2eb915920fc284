"""How a quantized GGUF model computes a step (``numerics``): genkit's own float operations, or
llama.cpp's CPU backend op for op in the float order of one of its SIMD builds. Only names and
choices live here (no torch), so the CLI can check ``--numerics`` before anything heavy is imported;
:func:`genkit.models.quant.set_numerics` applies a setting to a model."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

NUMERICS = ("genkit", "llama.cpp", "llama.cpp-avx2", "llama.cpp-avx512", "llama.cpp-avx512-fp16")

# numerics="llama.cpp-avx2" / "-avx512" / "-avx512-fp16": ggml's float order in that SIMD build (the block
# kernel's gk_layer.llama: GK_LLAMA_AVX2, GK_LLAMA_AVX512, GK_LLAMA_AVX512FP16)
LLAMA_AVX2, LLAMA_AVX512, LLAMA_AVX512_FP16 = 1, 2, 3
LLAMA_NUMERICS = {"llama.cpp-avx2": LLAMA_AVX2, "llama.cpp-avx512": LLAMA_AVX512,
                  "llama.cpp-avx512-fp16": LLAMA_AVX512_FP16}


def check_numerics(numerics: Any) -> str:
    """``numerics`` if it is an accepted setting (:data:`NUMERICS`), else a ConfigError."""
    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise ConfigError(f"`numerics` must be one of {', '.join(repr(n) for n in NUMERICS)}; got {numerics!r}")
    return numerics


def is_llama_numerics(numerics: str) -> bool:
    """Whether a ``numerics`` setting is one of llama.cpp's (``"llama.cpp"`` or a build's): every step on
    the block kernel's decoder, with one activation digit."""
    return numerics.startswith("llama.cpp")


def native_llama_numerics() -> str:
    """The float order of llama.cpp built for this CPU (natively, or the CPU variant its releases pick):
    ``"llama.cpp-avx512-fp16"`` where the CPU has AVX-512 FP16 (ggml's AVX-512 code with float16
    arithmetic), ``"llama.cpp-avx512"`` where it has AVX-512 F, else ``"llama.cpp-avx2"``."""
    from .block_kernel import cpu_flags

    flags = cpu_flags()
    if "avx512f" not in flags:
        return "llama.cpp-avx2"
    return "llama.cpp-avx512-fp16" if "avx512_fp16" in flags else "llama.cpp-avx512"


def llama_float_order(numerics: str) -> int:
    """The block kernel's ``gk_layer.llama`` for a ``numerics`` setting: 0 for genkit's own operations,
    else the :data:`LLAMA_NUMERICS` order (``"llama.cpp"``: this CPU's, :func:`native_llama_numerics`)."""
    if numerics == "llama.cpp":
        numerics = native_llama_numerics()
    return LLAMA_NUMERICS.get(numerics, 0)
