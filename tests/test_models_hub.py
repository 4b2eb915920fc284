# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""load_model / load_tokenizer from a Hub id, with the real huggingface_hub client against the
test server (tests/hub_server.py): only the files a model needs are downloaded."""

from __future__ import annotations

import pytest
import torch
from hub_server import hub_server  # noqa: F401
from tolerance import logits_bound

import genkit

transformers = pytest.importorskip("transformers")


def _upload(folder, repo_id):
    from huggingface_hub import HfApi

    HfApi().create_repo(repo_id)
    HfApi().upload_folder(repo_id=repo_id, folder_path=str(folder))


def test_hub_model_downloads_only_needed_files(hub_server, tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    folder = tmp_path / "repo"
    hf.save_pretrained(folder, max_shard_size="100KB")  # sharded, with an index
    (folder / "pytorch_model.bin").write_bytes(b"legacy weights nobody should fetch")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"onnx")
    (folder / "README.md").write_text("# tiny\n")
    _upload(folder, "org/tiny")

    model = genkit.load_model("org/tiny")
    ids = torch.tensor([[1, 5, 9, 33]])
    torch.testing.assert_close(model(ids).logits, hf(ids).logits, atol=logits_bound(model, ids), rtol=0)
    fetched = {p.split("/resolve/", 1)[1].split("/", 1)[1] for _, p in hub_server.state.file_requests()}
    shards = {p.name for p in folder.glob("model-*.safetensors")}
    assert len(shards) > 1
    assert fetched == {"config.json", "generation_config.json", "model.safetensors.index.json"} | shards


def test_hub_revision_is_honoured(hub_server, tmp_path, tiny_hf_dir):
    import shutil

    folder = tmp_path / "repo"
    shutil.copytree(tiny_hf_dir, folder)
    _upload(folder, "org/rev")
    hub_server.state.tag("org/rev", "v1")
    first = genkit.load_model("org/rev", revision="v1")
    # a later commit on main changes the generation config; the tag still gives the old one
    hub_server.state.commit("org/rev", {"generation_config.json": '{"max_length": 7, "eos_token_id": 2}'})
    assert genkit.load_model("org/rev").generation_config.max_length == 7
    assert genkit.load_model("org/rev", revision="v1").generation_config.max_length == \
        first.generation_config.max_length != 7


def test_hub_tokenizer_downloads_only_tokenizer_files(hub_server, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "repo"
    folder.mkdir()
    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "<eos>": 3}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    (folder / "model.safetensors").write_bytes(b"not needed for a tokenizer")
    _upload(folder, "org/tok")
    tok = genkit.load_tokenizer("org/tok")
    assert tok("ab a b")["input_ids"] == [2, 0, 1] and tok.eos_token_id == 3
    fetched = {p.rsplit("/", 1)[1] for _, p in hub_server.state.file_requests()}
    assert fetched == {"tokenizer.json", "tokenizer_config.json"}


def test_unknown_hub_repo_error_names_it(hub_server):
    with pytest.raises(Exception, match="org/missing"):
        genkit.load_model("org/missing")
