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


# -- a Hub that trickles: the HTTP library's timeouts are per read, genkit's limits are wall-clock --------
def _cache_files() -> list[str]:
    import os
    from pathlib import Path

    cache = Path(os.environ["HF_HUB_CACHE"])
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and ".locks" not in p.parts)


def _fake_model(hub_server, repo: str) -> str:
    return hub_server.state.commit(repo, {"config.json": '{"model_type": "llama"}', "model.safetensors": b"w" * 4000})


def test_a_hub_trickling_answer_headers_is_stopped_at_the_per_request_limit(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")  # answer headers within 1.5 s; the trickle needs ~40 s
    sha = _fake_model(hub_server, "org/slow")
    hub_server.state.drip_headers_next(1, 0.1, match=r"/resolve/.*config\.json")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"could not load model 'org/slow': the Hub was too slow: GET "
                                             rf"/org/slow/resolve/{sha}/config.json sent no complete answer headers "
                                             r"within 1.5 s \(6 x GENKIT_HUB_TIMEOUT\)"):
        genkit.load_model("org/slow")
    assert time.monotonic() - start < 5
    assert not [f for f in _cache_files() if f.endswith(("config.json", ".incomplete"))], _cache_files()


def test_a_hub_trickling_a_body_is_stopped_at_the_download_limit(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "2")  # the weights need 4000 x 0.05 s = 200 s
    _fake_model(hub_server, "org/drip")
    hub_server.state.drip_next(10, 0.05, match=r"GET .*/resolve/.*model\.safetensors")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"could not load model 'org/drip': the Hub was too slow: GET "
                                             r"/org/drip/resolve/\w+/model.safetensors stopped: the download of "
                                             r"org/drip did not finish within 2 s \(GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
        genkit.load_model("org/drip")
    assert time.monotonic() - start < 5
    assert len([p for m, p in hub_server.state.file_requests() if m == "GET" and "model.safetensors" in p]) == 1
    assert not [f for f in _cache_files() if f.endswith(("model.safetensors", ".incomplete"))], _cache_files()


def test_a_download_after_a_stopped_one_is_not_limited_by_it(hub_server, monkeypatch, tmp_path, tiny_hf_dir):
    import shutil

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")
    shutil.copytree(tiny_hf_dir, tmp_path / "repo")
    _upload(tmp_path / "repo", "org/ok")
    hub_server.state.drip_headers_next(1, 0.1, match=r"/resolve/.*config\.json")
    with pytest.raises(genkit.errors.ModelLoadError, match="sent no complete answer headers"):
        genkit.load_model("org/ok")
    assert genkit.load_model("org/ok").config.vocab_size == 128  # the Hub client's factory is as it was


def test_a_config_file_whose_headers_trickle_is_a_model_load_error(hub_server, monkeypatch):
    import time

    from genkit.config import GenerationConfig
    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")
    sha = hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    hub_server.state.drip_headers_next(1, 0.1, match=r"generation_config\.json")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"could not fetch generation_config.json of 'org/gc' from the Hub: the "
                                             rf"Hub was too slow: GET /org/gc/resolve/(main|{sha})/generation_config.json "
                                             r"sent no complete answer headers within 1.5 s"):
        GenerationConfig.from_pretrained("org/gc")
    assert time.monotonic() - start < 5
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7


@pytest.mark.parametrize(("name", "value"), [("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "0"),
                                             ("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "inf"), ("GENKIT_HUB_TIMEOUT", "x")])
def test_download_limits_out_of_range_are_errors_before_any_request(hub_server, monkeypatch, name, value):
    from genkit.errors import ConfigError

    _fake_model(hub_server, "org/m")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}='{value}' is not accepted; use a number of seconds > 0"):
        genkit.load_model("org/m")
    assert not [p for _, p in hub_server.state.log if "org/m" in p]
