"""The kernels a CPU picks, forced one by one, so a path this CPU would not take by itself still runs
here and in CI (whose machine changes between AVX2-only and AVX-512 / AMX CPUs): torch's ATen
capability (``ATEN_CPU_CAPABILITY``), oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA``: the packed
float32 weights of the inference path), genkit's block kernel build (``GENKIT_BLOCK_KERNEL``), and
the block kernel's AVX-512 VNNI source, compiled on every machine. The logits of each agree with this
process's float32 modules within the derived bounds of tests/tolerance.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_block_kernel import HAS_AVX2
from test_quantized import IDS as QUANTIZED_IDS
from test_quantized import MASK, quantized_roundoff, write_quantized_gguf
from tolerance import logits_bound

import genkit
from genkit.models import block_kernel
from genkit.models.tiny import tiny_llama

SCRIPT = """
import json, sys, torch, genkit
from genkit.models.tiny import tiny_llama
ids, mask = torch.tensor(json.loads(sys.argv[2])), torch.tensor(json.loads(sys.argv[3]))
model = tiny_llama(seed=3)
model.cpu_weight_packing = True  # oneDNN-packed float32 weights, where oneDNN runs on this CPU
with torch.inference_mode():
    packed = model(ids, attention_mask=mask).logits
q = genkit.load_model(sys.argv[1])
with torch.no_grad():
    quantized = q(ids, attention_mask=mask).logits
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "packed": packed.tolist(),
                  "quantized": quantized.tolist(), "kernel": q.model.layers[0].self_attn.q_proj.kernel}))
"""

IDS = QUANTIZED_IDS.clamp(max=99)  # within the tiny model's vocabulary too

FORCED = {
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, "DEFAULT"),  # no vector instructions in ATen
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2"),
    "onednn-sse41": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, None),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, None),
    "blocks-portable": ({"GENKIT_BLOCK_KERNEL": "portable"}, None),
    "blocks-avx2": ({"GENKIT_BLOCK_KERNEL": "avx2"}, None),
    "blocks-off": ({"GENKIT_BLOCK_KERNEL": "0"}, None),  # torch's int4 kernel (bfloat16 activations)
}


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cpu_paths") / "q.gguf"
    write_quantized_gguf(path, "Q4_1")
    return path


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_forced_cpu_path_gives_the_modules_logits(name, quantized_file):
    env, capability = FORCED[name]
    if "avx2" in name and not HAS_AVX2:
        pytest.skip("this CPU has no AVX2: the AVX2 paths cannot run here")
    if env.get("GENKIT_BLOCK_KERNEL", "0") != "0" and not block_kernel.available():
        pytest.skip("no C compiler for the block kernel")
    run_env = {**os.environ, **env, "OMP_NUM_THREADS": "1"}  # the block kernel builds cached as usual
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(quantized_file), json.dumps(IDS.tolist()),
                           json.dumps(MASK.tolist())], capture_output=True, text=True, env=run_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if capability is not None:
        assert got["capability"] == capability
    if name.startswith("blocks"):
        assert got["kernel"] == ("torch" if name == "blocks-off" else "blocks")
    model = tiny_llama(seed=3)
    with torch.enable_grad():  # this process's float32 modules
        ref = model(IDS, attention_mask=MASK).logits.detach()
    torch.testing.assert_close(torch.tensor(got["packed"]), ref, rtol=0, atol=logits_bound(model, IDS, MASK))
    f = genkit.load_model(quantized_file, dequantize=True)
    atol = logits_bound(f, IDS, MASK, linear_u=quantized_roundoff(got["kernel"]))
    torch.testing.assert_close(torch.tensor(got["quantized"]), f(IDS, attention_mask=MASK).logits, rtol=0, atol=atol)


def test_the_avx512_vnni_source_compiles_on_every_machine(tmp_path):
    """-march=native takes the VNNI branch only on an AVX-512 VNNI CPU: compile it everywhere (it is not
    run where the CPU lacks the instructions), so an AVX2 machine's CI still catches a broken branch."""
    cc = block_kernel._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "vnni.so"
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall", "-Werror",
             "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"]
    proc = subprocess.run([cc, *flags, str(block_kernel.SOURCE), "-o", str(out), "-lm"], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0 and "unrecognized" in proc.stderr and shutil.which(cc):
        pytest.skip(f"{cc} does not know the AVX-512 VNNI flags")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nm = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True, check=False).stdout
    assert "gk_simd" in nm and "gk_matmul" in nm and "gk_decode" in nm


def test_the_amx_source_compiles_on_every_machine(tmp_path):
    """The AMX int8 path is compiled only with AMX flags (-march=native on an AMX CPU): compile it
    everywhere, warnings as errors, so a machine without AMX still catches a broken branch."""
    cc = block_kernel._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "amx.so"
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall", "-Werror", "-mavx512f", "-mavx512bw",
             "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", "-mamx-tile", "-mamx-int8"]
    proc = subprocess.run([cc, *flags, str(block_kernel.SOURCE), "-o", str(out), "-lm"], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0 and "unrecognized" in proc.stderr:
        pytest.skip(f"{cc} does not know the AMX flags")
    assert proc.returncode == 0, proc.stderr[-3000:]
    nm = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True, check=False).stdout
    assert "gk_amx_init" in nm and "gk_decode_paged" in nm
    dis = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True, check=False).stdout
    if dis:
        assert "tdpbsud" in dis and "ldtilecfg" in dis  # the tile instructions are really there


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_products_equal_the_vnni_path_bit_for_bit(bits):
    """Where the CPU has AMX-INT8 and Linux grants the tiles: the same integer sums, scaled in the same
    order, so AMX and VNNI give identical float32 products (prefill-sized, batch-sized, ragged rows: 29 rows
    end in a tile group padded to 16, 37 in 5 rows the AMX call leaves to the vector path)."""
    if not block_kernel.available() or not block_kernel.amx_available():
        pytest.skip("this CPU (or kernel) has no AMX-INT8: the AMX path cannot run here")
    gen = torch.Generator().manual_seed(bits)
    n, k = 64, 256
    codes = torch.randint(0, 2 ** bits, (n, k), generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3
    minimum = -scale * (2 ** (bits - 1))
    blocks = block_kernel.pack(codes, scale, minimum, bits)
    for rows in (2, 16, 29, 37):
        x = torch.randn(rows, k, generator=gen)
        vnni = block_kernel.matmul(x, blocks, bits, n, amx_rows=0)
        amx = block_kernel.matmul(x, blocks, bits, n, amx_rows=1)
        assert torch.equal(amx, vnni), rows
