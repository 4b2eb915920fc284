"""issue 28, the kernel cache: a library planted at the block kernel's cache name (a plain file, a
symlink, or in a folder others can write) is never loaded; a corrupt cached library is rebuilt;
cache files are never group/other-writable whatever the umask; processes building at once end with
one good library."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from genkit.models import block_kernel

CC = block_kernel._compiler()
pytestmark = pytest.mark.skipif(CC is None or sys.platform != "linux", reason="needs a C compiler on Linux")

# loads the kernel (the portable build, on any CPU) and computes a product with it
PROBE = """
import json, torch
from genkit.models import block_kernel as bk
codes = torch.arange(32 * 64).reshape(32, 64) % 16
scale, minimum = torch.full((32, 2), 0.5), torch.full((32, 2), -1.0)
y = bk.matmul(torch.ones(1, 64), bk.pack(codes, scale, minimum, 4), 4, 32)
print(json.dumps({"available": bk.available(), "y0": y[0, :3].tolist()}))
"""
EVIL = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("GK_MARKER"), "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
int gk_simd(void) { return 0; }
"""


def _probe(home: Path, marker: Path, umask: int | None = None) -> tuple[dict, str]:
    env = {**os.environ, "GENKIT_HOME": str(home), "GENKIT_BLOCK_KERNEL": "portable", "GK_MARKER": str(marker)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300,
                         preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _name() -> str:
    return block_kernel.cache_name(CC, "portable")


def _evil(tmp_path: Path) -> Path:
    src, lib = tmp_path / "evil.c", tmp_path / "evil.so"
    src.write_text(EVIL)
    subprocess.run([CC, "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=120)
    return lib


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("ref")
    want, _ = _probe(home, home / "marker")
    assert want["available"]
    return want


def test_a_planted_plain_file_is_never_loaded_and_is_rebuilt(tmp_path, reference):
    kernels = tmp_path / "home" / "kernels"
    kernels.mkdir(parents=True, mode=0o755)
    shutil.copy(_evil(tmp_path), kernels / _name())
    marker = tmp_path / "marker"
    got, err = _probe(tmp_path / "home", marker)
    assert not marker.exists(), "the planted library was loaded"
    assert got == reference
    assert "sha256 does not match" in err
    assert (kernels / (_name() + ".sha256")).is_file()


def test_a_planted_symlink_is_never_loaded(tmp_path, reference):
    kernels = tmp_path / "home" / "kernels"
    kernels.mkdir(parents=True, mode=0o755)
    evil = _evil(tmp_path)
    (kernels / _name()).symlink_to(evil)
    # even with a digest that matches the planted file
    (kernels / (_name() + ".sha256")).write_text(hashlib.sha256(evil.read_bytes()).hexdigest())
    marker = tmp_path / "marker"
    got, err = _probe(tmp_path / "home", marker)
    assert not marker.exists(), "the planted library was loaded"
    assert got == reference and "symlink is refused" in err
    assert not (kernels / _name()).is_symlink() and (kernels / _name()).is_file()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_folder_others_can_write_is_not_used(tmp_path, reference, mode):
    home = tmp_path / "home"
    kernels = home / "kernels"
    kernels.mkdir(parents=True)
    os.chmod(home, 0o777)
    os.chmod(kernels, mode)
    evil = _evil(tmp_path)
    shutil.copy(evil, kernels / _name())
    (kernels / (_name() + ".sha256")).write_text(hashlib.sha256(evil.read_bytes()).hexdigest())
    marker = tmp_path / "marker"
    got, err = _probe(home, marker)
    assert not marker.exists(), "the planted library was loaded"
    assert got == reference  # built privately for this process
    assert "is writable by group or others" in err and str(kernels) in err
    assert sorted(p.name for p in kernels.iterdir()) == sorted([_name(), _name() + ".sha256"])  # nothing written there


def test_a_corrupt_cached_library_is_rebuilt(tmp_path, reference):
    home, marker = tmp_path / "home", tmp_path / "marker"
    _probe(home, marker)
    lib = home / "kernels" / _name()
    good = lib.read_bytes()
    lib.write_bytes(good[: len(good) // 2])  # truncated
    got, err = _probe(home, marker)
    assert got == reference and "sha256 does not match" in err
    assert lib.read_bytes() == good


def test_cache_files_are_never_group_or_other_writable(tmp_path, reference):
    for umask, want in ((0o000, 0o755), (0o022, 0o755), (0o077, 0o700)):
        home = tmp_path / f"home{umask:o}"
        got, _ = _probe(home, tmp_path / "marker", umask=umask)
        assert got == reference
        kernels = home / "kernels"
        modes = {p.name: p.stat().st_mode & 0o777 for p in [kernels, *kernels.iterdir()]}
        assert modes["kernels"] == want, modes
        assert modes[_name()] == want, modes
        assert modes[_name() + ".sha256"] == want & 0o644, modes


def test_processes_building_at_once_end_with_one_good_library(tmp_path, reference):
    home = tmp_path / "home"
    env = {**os.environ, "GENKIT_HOME": str(home), "GENKIT_BLOCK_KERNEL": "portable", "GK_MARKER": "/dev/null"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == reference
    names = sorted(p.name for p in (home / "kernels").iterdir())
    assert names == sorted([".build.lock", _name(), _name() + ".sha256"]), names
