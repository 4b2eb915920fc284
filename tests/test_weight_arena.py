"""genkit.models.weight_arena: weights moved into 2 MB-aligned memory advised MADV_HUGEPAGE."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from genkit.errors import ConfigError
from genkit.models import weight_arena
from genkit.models.saving import write_safetensors

pytestmark = pytest.mark.skipif(not weight_arena.enabled(), reason="no transparent huge pages here (not Linux, or THP never)")


def vma_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_place_moves_weights_into_huge_page_memory_keeping_values_identity_and_saving(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(1024, 768, bias=True)
    emb = nn.Embedding(768, 1024)
    lin.weight = emb.weight  # tied: one Parameter under two names, placed once
    col = torch.randn(512, 1024).t()  # column-major, as the float path stores its weights
    before = {"w": lin.weight.detach().clone(), "col": col.clone()}
    x = torch.randn(3, 1024)
    want = lin(x)
    moved = weight_arena.place([lin.weight, emb.weight, col, lin.bias])
    assert moved == 768 * 1024 * 4 + 512 * 1024 * 4 + weight_arena.ALIGN  # the bias (3 KB) takes a page
    assert lin.weight is emb.weight and isinstance(lin.weight, nn.Parameter) and lin.weight.requires_grad
    assert torch.equal(lin.weight, before["w"]) and torch.equal(col, before["col"]) and col.stride() == (1, 1024)
    assert lin.weight.data_ptr() % weight_arena.HUGE_PAGE == 0
    assert col.data_ptr() % weight_arena.ALIGN == 0
    assert torch.equal(lin(x), want)
    vma = vma_of(lin.weight.data_ptr())
    if "THPeligible" in vma:
        assert vma["THPeligible"] == "1", vma
    write_safetensors(str(tmp_path / "w.safetensors"), {k: v for k, v in lin.state_dict().items()})
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["weight"], before["w"])
    lin.to(torch.bfloat16)  # leaves the mapping: an ordinary CPU tensor
    assert lin.weight.dtype == torch.bfloat16


def test_genkit_huge_pages_0_leaves_the_tensors_where_they_are(monkeypatch):
    monkeypatch.setenv("GENKIT_HUGE_PAGES", "0")
    t = torch.randn(1024, 1024)
    ptr = t.data_ptr()
    assert weight_arena.place([t]) == 0
    assert t.data_ptr() == ptr


def test_small_tensors_are_left_alone():
    t = torch.randn(256, 256)  # 256 KB in all: under one huge page
    ptr = t.data_ptr()
    assert weight_arena.place([t]) == 0 and t.data_ptr() == ptr


def test_a_bad_genkit_huge_pages_value_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("GENKIT_HUGE_PAGES", "maybe")
    with pytest.raises(ConfigError, match=r"GENKIT_HUGE_PAGES='maybe' is not accepted; use one of 1, on"):
        weight_arena.place([torch.randn(1024, 1024)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_off_linux_or_with_thp_never_nothing_moves(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(weight_arena, "_THP_SETTING", str(setting))
    t = torch.randn(1024, 1024)
    assert not weight_arena.enabled() and weight_arena.place([t]) == 0
    monkeypatch.setattr(sys, "platform", "darwin")
    setting.write_text("always [madvise] never\n")
    assert not weight_arena.enabled()
