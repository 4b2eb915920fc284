# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""load_model / load_tokenizer from a Hub id, with the real huggingface_hub client against the
test server (tests/hub_server.py): only the files a model needs are downloaded."""

from __future__ import annotations

from typing import Any

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


def _gets(hub_server, name: str, method: str = "GET") -> list[str]:
    return [p for m, p in hub_server.state.file_requests() if m == method and p.endswith("/" + name)]


def _upload_tiny(hub_server, tmp_path, tiny_hf_dir, repo: str) -> None:
    import shutil

    shutil.copytree(tiny_hf_dir, tmp_path / repo)
    _upload(tmp_path / repo, repo)


@pytest.mark.parametrize(("method", "name"), [("GET", "model.safetensors"), ("HEAD", "config.json")])
def test_answer_headers_that_trickle_are_tried_again_as_huggingface_hub_does_a_read_timeout(
        hub_server, monkeypatch, tmp_path, tiny_hf_dir, method, name):
    import time

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")  # answer headers within 1.5 s; a trickle needs ~40 s
    _upload_tiny(hub_server, tmp_path, tiny_hf_dir, "org/retry")
    hub_server.state.drip_headers_next(2, 0.1, match=rf"{method} .*/resolve/.*/{name}$")
    start = time.monotonic()
    assert genkit.load_model("org/retry").config.vocab_size == 128
    # huggingface_hub tries a GET whose headers time out again 5 times, and a HEAD once alone, then 5 times
    # with backoff (file_download.http_get, hf_hub_download): the third try here gets an answer
    assert len(_gets(hub_server, name, method)) == 3
    assert time.monotonic() - start >= 2 * 1.5  # the first two were stopped at the per-request limit


def test_answer_headers_that_always_trickle_stop_after_huggingface_hubs_tries(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.1")  # answer headers within 0.6 s; a trickle needs ~30 s
    sha = _fake_model(hub_server, "org/slow")
    hub_server.state.drip_headers_next(100, 0.1, match=r"GET .*/resolve/.*model\.safetensors")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"could not load model 'org/slow': the Hub was too slow: GET "
                                             rf"/org/slow/resolve/{sha}/model.safetensors sent no complete answer "
                                             r"headers within 0.6 s \(6 x GENKIT_HUB_TIMEOUT\)"):
        genkit.load_model("org/slow")
    assert len(_gets(hub_server, "model.safetensors")) == 6  # the first try and huggingface_hub's 5 more
    assert 6 * 0.6 + 5 * 1 <= time.monotonic() - start < 60  # 6 tries, 1 s apart (http_get's pause)
    assert not [f for f in _cache_files() if f.endswith(("model.safetensors", ".incomplete"))], _cache_files()


def test_tries_again_stop_at_the_download_limit(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")  # answer headers within 1.5 s
    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "4")  # huggingface_hub's 6 tries would need 14 s
    sha = _fake_model(hub_server, "org/slow")
    hub_server.state.drip_headers_next(100, 0.1, match=r"GET .*/resolve/.*model\.safetensors")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"could not load model 'org/slow': the Hub was too slow: GET "
                                             rf"/org/slow/resolve/{sha}/model.safetensors stopped: the download of "
                                             r"org/slow did not finish within 4 s \(GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
        genkit.load_model("org/slow")
    assert 4 <= time.monotonic() - start < 4 + 1.5 + 5  # the limit, at most one per-request limit and pause after
    assert 1 <= len(_gets(hub_server, "model.safetensors")) <= 3  # a try begun past the limit is never sent


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
    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "2")
    _upload_tiny(hub_server, tmp_path, tiny_hf_dir, "org/ok")
    hub_server.state.drip_next(1, 0.05, match=r"GET .*/resolve/.*model\.safetensors")
    with pytest.raises(genkit.errors.ModelLoadError, match="GENKIT_MODEL_DOWNLOAD_TIMEOUT"):
        genkit.load_model("org/ok")
    monkeypatch.delenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT")
    hub_server.state.delay_next(1, 2.5, match=r"GET .*/resolve/.*model\.safetensors")  # past the first one's limit
    assert genkit.load_model("org/ok").config.vocab_size == 128


def test_a_config_file_whose_headers_always_trickle_is_a_model_load_error(hub_server, monkeypatch):
    import time

    from genkit.config import GenerationConfig
    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")  # answer headers within 1.5 s
    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "3")
    hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    hub_server.state.drip_headers_next(100, 0.1, match=r"generation_config\.json")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"could not fetch generation_config.json of 'org/gc' from the Hub: the "
                                             r"Hub was too slow: HEAD /org/gc/resolve/main/generation_config.json "
                                             r"stopped: the download of generation_config.json of org/gc did not "
                                             r"finish within 3 s \(GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
        GenerationConfig.from_pretrained("org/gc")
    assert 3 <= time.monotonic() - start < 3 + 1.5 + 5
    hub_server.state.faults.clear()
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7


# -- a Retry-After longer than the time left is not waited for -----------------------------------------------
@pytest.mark.parametrize(("method", "name", "status", "headers", "said"), [
    ("GET", "model.safetensors", 429, {"Retry-After": "30"}, "Retry-After: 30 s"),
    ("HEAD", "config.json", 503, {"Retry-After": "30"}, "Retry-After: 30 s"),
    ("GET", "model.safetensors", 429, {"RateLimit": '"api";r=0;t=30', "Retry-After": "1"}, "its rate limit spent for 30 s"),
])
def test_a_retry_after_past_the_download_limit_fails_at_once(hub_server, monkeypatch, method, name, status, headers,
                                                             said):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "5")
    sha = _fake_model(hub_server, "org/busy")
    hub_server.state.answer_next(5, rf"{method} .*/resolve/.*/{name}$", status=status, headers=headers)
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"could not load model 'org/busy': the Hub was too slow: {method} "
                                             rf"/org/busy/resolve/{sha}/{name} answered {status} with {said}, past "
                                             r"the end of the download of org/busy \(\d\.\d s left of 5 s, "
                                             r"GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
        genkit.load_model("org/busy")
    assert time.monotonic() - start < 5  # not the 31 s huggingface_hub would wait


def test_a_retry_after_within_the_download_limit_is_honoured(hub_server):
    import time

    from genkit.config import GenerationConfig

    hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    hub_server.state.answer_next(1, r"GET .*generation_config\.json", status=429, headers={"Retry-After": "1"})
    start = time.monotonic()
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7
    assert time.monotonic() - start >= 1 + 1  # huggingface_hub waits Retry-After + 1 s, then tries again
    # a cached file is used when the Hub asks for a wait far past the limit (huggingface_hub's fallback on an error)
    hub_server.state.answer_next(1, r"HEAD .*generation_config\.json", status=503, headers={"Retry-After": "99999"})
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7


# -- each download's limits are its own: other threads' Hub requests meanwhile are not bound by them ------
def _start_slow_download(hub_server, repo: str) -> tuple[Any, list[BaseException]]:
    """Load ``repo`` in a thread whose weights trickle (200 s), once its weights' GET has begun."""
    import threading
    import time

    _fake_model(hub_server, repo)
    hub_server.state.drip_next(1, 0.05, match=rf"GET /{repo}/resolve/.*model\.safetensors")
    errors: list[BaseException] = []

    def load() -> None:
        try:
            genkit.load_model(repo)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    until = time.monotonic() + 60
    while not _gets(hub_server, "model.safetensors"):  # the slow download's watched GET is under way
        assert thread.is_alive() and time.monotonic() < until, errors
        time.sleep(0.02)
    return thread, errors


def test_another_threads_hub_requests_are_not_bound_by_a_download_limit(hub_server, monkeypatch):
    from huggingface_hub import hf_hub_download

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "2.5")
    data = bytes(range(40))
    hub_server.state.commit("org/other", {"data.bin": data})
    hub_server.state.drip_next(1, 0.1, match=r"GET /org/other/resolve/.*data\.bin")  # 4 s: past org/drip's limit
    thread, errors = _start_slow_download(hub_server, "org/drip")
    with open(hf_hub_download("org/other", "data.bin"), "rb") as f:  # begun within org/drip's 2.5 s
        assert f.read() == data
    thread.join(60)
    assert len(errors) == 1 and "org/drip did not finish within 2.5 s (GENKIT_MODEL_DOWNLOAD_TIMEOUT)" in str(errors[0])


def test_a_second_download_does_not_wait_for_a_slow_one(hub_server, monkeypatch):
    from genkit.config import GenerationConfig

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "6")
    hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    thread, errors = _start_slow_download(hub_server, "org/drip")
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7
    assert thread.is_alive()  # done while the slow download is still under way (it ends at its 6 s limit)
    thread.join(60)
    assert len(errors) == 1 and "org/drip did not finish within 6 s (GENKIT_MODEL_DOWNLOAD_TIMEOUT)" in str(errors[0])


@pytest.mark.parametrize(("name", "value"), [("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "0"),
                                             ("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "inf"), ("GENKIT_HUB_TIMEOUT", "x")])
def test_download_limits_out_of_range_are_errors_before_any_request(hub_server, monkeypatch, name, value):
    from genkit.errors import ConfigError

    _fake_model(hub_server, "org/m")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}='{value}' is not accepted; use a number of seconds > 0"):
        genkit.load_model("org/m")
    assert not [p for _, p in hub_server.state.log if "org/m" in p]
def test_downloads_keep_the_hub_clients_session(hub_server):
    from huggingface_hub.utils import get_session

    from genkit.config import GenerationConfig

    hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7
    session = get_session()
    assert GenerationConfig.from_pretrained("org/gc", force_download=True).max_length == 7
    assert get_session() is session  # made once and kept, as huggingface_hub means it to be; not one per download


# -- Xet storage: hf_xet's transfers are not the hooked HTTP client's, so a bounded download keeps off them --
def _serve_through_xet(hub_server, monkeypatch, *names: str) -> None:
    """Serve ``names`` as Xet-backed files, with huggingface_hub's Xet path on (as it is for a user with
    hf_xet installed) and a Xet storage that answers nothing for 8 s (hf_xet's own timeouts are minutes)."""
    from huggingface_hub import constants

    pytest.importorskip("hf_xet")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    hub_server.state.xet_files.update(names)
    hub_server.state.cas_stall = 8.0


def _xet_requests(hub_server) -> list[str]:
    return [p for _, p in hub_server.state.log if "/xet-read-token/" in p or p.startswith("/cas/")]


def test_a_xet_backed_model_is_downloaded_over_http_within_the_limit(hub_server, monkeypatch, tmp_path, tiny_hf_dir):
    """snapshot_download takes the Xet path straight from the file listing (no HEAD); hf_xet's bytes would be
    out of reach of GENKIT_MODEL_DOWNLOAD_TIMEOUT (here: 8 s of silence from the storage, past the 4 s limit)."""
    import time

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "4")
    _upload_tiny(hub_server, tmp_path, tiny_hf_dir, "org/xet")
    _serve_through_xet(hub_server, monkeypatch, "model.safetensors")
    start = time.monotonic()
    assert genkit.load_model("org/xet").config.vocab_size == 128
    assert time.monotonic() - start < 4
    assert _xet_requests(hub_server) == []
    assert len(_gets(hub_server, "model.safetensors")) == 1  # its bytes came through the bounded HTTP client


def test_a_xet_backed_config_file_is_downloaded_over_http(hub_server, monkeypatch):
    """hf_hub_download takes the Xet path from the HEAD answer's X-Xet-Hash (and its refresh route)."""
    from genkit.config import GenerationConfig

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "4")
    hub_server.state.commit("org/gc", {"generation_config.json": '{"max_length": 7}'})
    _serve_through_xet(hub_server, monkeypatch, "generation_config.json")
    assert GenerationConfig.from_pretrained("org/gc").max_length == 7
    assert _xet_requests(hub_server) == []
    assert len(_gets(hub_server, "generation_config.json")) == 1


def test_a_xet_backed_file_that_trickles_is_stopped_at_the_download_limit(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "2")  # the weights need 4000 x 0.05 s = 200 s
    _fake_model(hub_server, "org/xdrip")
    _serve_through_xet(hub_server, monkeypatch, "model.safetensors")
    hub_server.state.drip_next(10, 0.05, match=r"GET .*/resolve/.*model\.safetensors")
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"could not load model 'org/xdrip': the Hub was too slow: GET "
                                             r"/org/xdrip/resolve/\w+/model.safetensors stopped: the download of "
                                             r"org/xdrip did not finish within 2 s \(GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
        genkit.load_model("org/xdrip")
    assert time.monotonic() - start < 5
    assert _xet_requests(hub_server) == []


def test_a_xet_listing_cached_by_an_earlier_download_is_named_in_a_warning(hub_server, monkeypatch, caplog):
    """A file listing an earlier download (huggingface_hub's own, Xet on) left in the cache sends
    huggingface_hub straight to Xet storage for a file not yet downloaded, with no request genkit could
    change: genkit says so, naming the download, the setting and the way out."""
    import logging

    from huggingface_hub import snapshot_download

    from genkit.errors import ModelLoadError

    _fake_model(hub_server, "org/cached")
    _serve_through_xet(hub_server, monkeypatch, "model.safetensors")
    hub_server.state.cas_stall = 0.0  # the fake storage has no Xet data: the download fails at once
    snapshot_download("org/cached", allow_patterns=["config.json"])  # lists every file, with its Xet hash
    with caplog.at_level(logging.WARNING, logger="genkit.hubhttp"), pytest.raises(ModelLoadError):
        genkit.load_model("org/cached")
    assert [r.getMessage() for r in caplog.records if r.name == "genkit.hubhttp"] == [
        "the download of org/cached fetches a file through Xet storage (huggingface_hub took its Xet hash from a "
        "file listing an earlier download left in the Hub cache): hf_xet moves its bytes, which "
        "GENKIT_MODEL_DOWNLOAD_TIMEOUT does not bound; set HF_HUB_DISABLE_XET=1 to download over HTTP within the limit"]
    assert [p for p in _xet_requests(hub_server) if p.startswith("/cas/")]  # hf_xet went to the storage
