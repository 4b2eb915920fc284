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
    with pytest.raises(ConfigError, match="GENKIT_HUGE_PAGES"):
        weight_arena.place([torch.randn(4)])  # checked even where nothing would move


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


def test_a_float_models_prepared_weights_sit_in_huge_pages_and_give_the_same_tokens(monkeypatch, tmp_path):
    """hidden 256, vocab 2048, 2 layers: ~6 MB of float32 matrices, placed when the model is prepared
    (fused q/k/v and gate/up, whose row blocks the q/k/v and gate/up parameters stay views of)."""
    import genkit
    from genkit.models.tiny import tiny_llama

    ids = torch.tensor([[5, 17, 300, 9, 1000]])
    outs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("GENKIT_HUGE_PAGES", env)
        model = tiny_llama(seed=3, hidden_size=256, intermediate_size=512, vocab_size=2048, num_attention_heads=8)
        model.cpu_weight_packing = False  # the plain weights are the ones the decode products read
        outs[env] = model.generate(ids, max_new_tokens=12, eos_token_id=None)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        storages = {w.untyped_storage().data_ptr() for w in (attn.q_proj.weight, attn.v_proj.weight,
                                                             attn.o_proj.weight, mlp.up_proj.weight, model.lm_head.weight)}
        assert len(storages) == (1 if env == "1" else 4)  # q and v: rows of one fused tensor either way
        if env == "1":
            assert vma_of(attn.q_proj.weight.data_ptr()).get("THPeligible", "1") == "1"
            for layer in model._prepared[1].layers:  # the fused weights moved whole: no base tensor keeps the
                for w in (layer.wqkv, layer.wgu):    # storage they were made in (SmolLM2: 265 MB kept twice)
                    assert w._base is None or w._base.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
            assert torch.equal(model.generate(ids, max_new_tokens=12, eos_token_id=None), outs["0"])  # kept prepared
            model.save_pretrained(tmp_path / "saved")
            again = genkit.load_model(tmp_path / "saved")
            assert torch.equal(again.generate(ids, max_new_tokens=12, eos_token_id=None), outs["0"])
    assert torch.equal(outs["0"], outs["1"])
