"""load_model's errors name the file, tensor or architecture at fault; the cache protocol."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tolerance import logits_bound

import genkit
from genkit.errors import (
    ConfigError,
    CorruptModelError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from genkit.models.cache import KVCache

transformers = pytest.importorskip("transformers")


@pytest.fixture
def folder(tiny_hf_dir, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, dest)
    return dest


def test_missing_safetensors_names_the_file(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        genkit.load_model(folder)


def test_missing_shard_names_the_shard(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"model-00001-of-00002\.safetensors"):
        genkit.load_model(folder)


def test_corrupt_safetensors_names_the_file(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # truncated download
    with pytest.raises(CorruptModelError, match=r"model\.safetensors.*corrupt"):
        genkit.load_model(folder)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptModelError, match=r"model\.safetensors.*corrupt"):
        genkit.load_model(folder)


def test_wrong_shape_names_the_tensor(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(100, 64\).*\(128, 64\)"):
        genkit.load_model(folder)


def test_missing_tensor_is_named(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.self_attn.k_proj.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(CorruptModelError, match=r"missing tensors \['model\.layers\.0\.self_attn\.k_proj\.weight'\]"):
        genkit.load_model(folder)


def test_unknown_architecture_is_named(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"unknown architecture 'FalconForCausalLM'.*LlamaForCausalLM"):
        genkit.load_model(folder)


def test_a_missing_model_is_a_model_load_error_and_a_file_not_found_error(folder, tmp_path):
    """docs/api.md: "a model or tokenizer could not be found" is a ModelLoadError (a GenkitError),
    still a FileNotFoundError for callers that catch that."""
    (tmp_path / "empty").mkdir()
    for load, ref, message in ((genkit.load_model, "./nowhere", "'./nowhere' not found"),
                               (genkit.load_model, tmp_path / "empty", "no config.json in"),
                               (genkit.load_tokenizer, tmp_path / "empty", "no tokenizer.json in")):
        with pytest.raises(ModelNotFoundError, match=message) as err:
            load(ref)
        assert isinstance(err.value, ModelLoadError) and isinstance(err.value, FileNotFoundError)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights in"):
        genkit.load_model(folder)


def test_missing_config_and_bad_refs(folder, tmp_path):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        genkit.load_model(folder)
    with pytest.raises(FileNotFoundError, match="'./nowhere' not found"):
        genkit.load_model("./nowhere")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a .gguf"):
        genkit.load_model(other)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(CorruptModelError, match="bad.gguf: not a readable GGUF"):
        genkit.load_model(bad)


def test_bad_dtype_lists_accepted_values(tiny_hf_dir):
    with pytest.raises(ConfigError, match="`dtype`='int8' is not supported; accepted: float32, bfloat16, float16"):
        genkit.load_model(tiny_hf_dir, dtype="int8")


def test_generation_config_is_read_from_the_folder(folder):
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg.update(max_length=33, do_sample=True, top_k=7)
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    model = genkit.load_model(folder)
    assert (model.generation_config.max_length, model.generation_config.top_k) == (33, 7)


def test_local_recipe_is_bound_only_when_trusted(folder):
    recipe = folder / "custom_generate"
    recipe.mkdir()
    (recipe / "generate.py").write_text(
        "def generate(model, input_ids=None, **kwargs):\n"
        "    return ('recipe', input_ids.shape, sorted(kwargs))\n")
    (folder / "README.md").write_text("---\ntags:\n- custom_generate\n---\nA test recipe.\n")
    plain = genkit.load_model(folder)
    ids = torch.tensor([[1, 5, 6]])
    assert isinstance(plain.generate(ids, max_new_tokens=2), torch.Tensor)
    trusted = genkit.load_model(folder, trust_remote_code=True)
    tag, shape, keys = trusted.generate(input_ids=ids, max_new_tokens=2)
    assert (tag, tuple(shape), keys) == ("recipe", (1, 3), ["max_new_tokens"])


# -- the cache protocol ---------------------------------------------------------------------------
def _filled_cache(batch=3, length=5):
    cache = KVCache(2)
    for layer in range(2):
        k = torch.arange(batch * length, dtype=torch.float32).view(batch, 1, length, 1).expand(batch, 2, length, 4)
        cache.update(layer, k.clone(), -k.clone())
    return cache


def test_kv_cache_crop_reorder_select_repeat():
    cache = _filled_cache()
    assert cache.get_seq_length() == 5
    cache.crop(3)
    assert cache.get_seq_length() == 3 and cache[0][0].shape == (3, 2, 3, 4)
    cache.crop(-1)
    assert cache.get_seq_length() == 2
    with pytest.raises(ConfigError, match="cannot crop"):
        cache.crop(-5)
    rows = cache[1][0][:, 0, 0, 0].clone()
    cache.reorder(torch.tensor([2, 0, 1]))
    assert torch.equal(cache[1][0][:, 0, 0, 0], rows[[2, 0, 1]])
    cache.select(torch.tensor([1]))
    assert cache[0][0].shape[0] == 1 and torch.equal(cache[0][0][:, 0, 0, 0], rows[[0]])
    cache.repeat_interleave(3)
    assert cache[0][0].shape == (3, 2, 2, 4) and torch.equal(cache[1][1][:, 0, 0, 0], -rows[[0, 0, 0]])
    # and it keeps growing after edits
    cache.update(0, torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4))
    assert cache.get_seq_length(0) == 3


def test_cropped_cache_continues_like_a_fresh_forward(tiny_pair):
    _, model = tiny_pair
    ids = torch.tensor([[1, 10, 20, 30, 40, 50, 60]])
    cache = model.new_cache()
    model(ids, past_key_values=cache)
    cache.crop(4)  # speculative rollback: drop the last 3 positions
    out = model(ids[:, 4:], past_key_values=cache).logits
    torch.testing.assert_close(out, model(ids, use_cache=False).logits[:, 4:], atol=logits_bound(model, ids), rtol=0)


def test_unsupported_activation_is_named(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"hidden_act 'gelu' is not supported for LlamaForCausalLM; accepted: 'silu'"):
        genkit.load_model(folder)
