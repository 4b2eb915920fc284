"""genkit.models.cpu: the one reader of /proc/cpuinfo (kernel builds, kernel choices, genkit info and
the benchmarks' CPU line all take it from there)."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from genkit.cli.info_cmd import cpu_lines
from genkit.models import block_kernel, cpu

# two logical CPUs of a Xeon guest as Linux prints them: only the first entry is read
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 7
model\t\t: 1
model name\t: Another CPU
flags\t\t: fpu
"""


@pytest.fixture
def cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the reader at a file of ours; the cached answer is dropped before and after."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu, "CPUINFO", str(path))
    cpu.cpu_info.cache_clear()
    yield path
    cpu.cpu_info.cache_clear()


def test_the_first_cpu_entry_gives_name_family_model_and_flags(cpuinfo: Path) -> None:
    cpuinfo.write_text(XEON, encoding="utf-8")
    info = cpu.cpu_info()
    assert (info.name, info.family, info.model) == ("Intel(R) Xeon(R) Processor", "6", "207")
    assert "amx_int8" in info.flags and "fpu" in info.flags and len(info.flags) == 12
    assert info.raw_flags.startswith("fpu sse2 avx2")
    assert block_kernel.cpu_flags() == set(info.flags)
    # the kernel-choice cache key keeps its format (name|flags line), so cached choices stay valid
    assert cpu.cache_key() == "Intel(R) Xeon(R) Processor|" + info.raw_flags


def test_describe_and_genkit_info_name_the_cpu_kind_and_the_kernel_flags(cpuinfo: Path) -> None:
    cpuinfo.write_text(XEON, encoding="utf-8")
    line = cpu.describe()
    assert line.startswith("cpu: Intel(R) Xeon(R) Processor (family 6 model 207), ")
    assert line.endswith("flags: avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8")
    assert cpu_lines() == [
        "cpu: Intel(R) Xeon(R) Processor (family 6 model 207)",
        f"cpu flags (of {', '.join(cpu.KERNEL_FLAGS)}): avx2 fma f16c avx512f avx512bw avx512_vnni avx512_bf16 "
        "avx512_fp16 amx_tile amx_int8",
    ]


def test_no_cpuinfo_gives_the_platform_name_and_no_flags(cpuinfo: Path) -> None:
    info = cpu.cpu_info()  # the file was never written
    assert info.name == (platform.processor() or "unknown")
    assert info.flags == frozenset() and info.family == ""
    assert cpu.describe().endswith("flags: (none of the kernels' flags)")
    assert "(family" not in cpu.describe()


def test_an_entry_without_flags_or_name_still_reads(cpuinfo: Path) -> None:
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd\n\n", encoding="utf-8")  # an Arm entry
    info = cpu.cpu_info()
    assert info.flags == frozenset({"fp", "asimd"})
    assert info.name == (platform.processor() or "unknown")
