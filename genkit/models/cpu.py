"""The CPU this process runs on, as genkit's kernels see it: the one reader of ``/proc/cpuinfo``.

The block and dense kernels key their builds on it, the per-CPU kernel choice keys its cache on it,
``genkit info`` prints it, and the benchmarks print :func:`describe` above their figures (a figure
is only comparable with another from the same CPU kind). Where there is no ``/proc/cpuinfo`` (not
Linux), the name is ``platform.processor()`` and the flag set is empty.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field

CPUINFO = "/proc/cpuinfo"
# the flags genkit's kernels and numerics choose paths by (genkit info and describe() list these)
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_int8", "amx_bf16", "avx_vnni")


@dataclass(frozen=True)
class CpuInfo:
    """The first CPU's entry in ``/proc/cpuinfo``."""

    name: str
    family: str = ""
    model: str = ""
    flags: frozenset[str] = field(default_factory=frozenset)
    raw_flags: str = ""  # the flags line's text, in the kernel's order (part of the cache keys)


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The first CPU's name, family, model and flags (read once per process)."""
    fields: dict[str, str] = {}
    try:
        with open(CPUINFO, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first CPU's entry ends at the first blank line
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return CpuInfo(name=platform.processor() or "unknown")
    flags = fields.get("flags") or fields.get("Features") or ""
    return CpuInfo(name=fields.get("model name") or platform.processor() or "unknown",
                   family=fields.get("cpu family", ""), model=fields.get("model", ""),
                   flags=frozenset(flags.split()), raw_flags=flags)


def cache_key() -> str:
    """``name|flags``: the CPU a kernel build or a kernel choice cached under ``$GENKIT_HOME`` was
    made for (another CPU kind, or a VM that hides a flag, gets its own)."""
    info = cpu_info()
    return f"{info.name}|{info.raw_flags}"


def kind() -> str:
    """The CPU's name with its family and model where /proc/cpuinfo gives them (many VMs name only
    "Intel(R) Xeon(R) Processor" or "AMD EPYC")."""
    info = cpu_info()
    return f"{info.name} (family {info.family} model {info.model})" if info.family else info.name


def kernel_flags() -> list[str]:
    """Which of :data:`KERNEL_FLAGS` this CPU has, in that order."""
    return [f for f in KERNEL_FLAGS if f in cpu_info().flags]


def describe() -> str:
    """One line naming this CPU kind: name, family and model, logical CPUs, the kernel flags it has."""
    have = " ".join(kernel_flags()) or "(none of the kernels' flags)"
    return f"cpu: {kind()}, {os.cpu_count() or 1} logical CPUs; flags: {have}"
