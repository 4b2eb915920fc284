# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""generation_config.json files: the ones transformers 4.57.1 and 5.23.0 wrote (committed under
tests/fixtures/generation_configs, made by make_fixtures.py there) read and written back unchanged,
the same effective values at generate time, and the loader/saver options of transformers'
``from_pretrained``/``save_pretrained`` (issue 18 item 1 and 4, issue 19 item 5)."""

from __future__ import annotations

import http.server
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from hub_server import hub_server  # noqa: F401

import genkit
from genkit import GenerationConfig

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "generation_configs"
VERSIONS = ("transformers-4.57.1", "transformers-5.23.0")
FILES = sorted(p.parent for v in VERSIONS for p in (FIXTURES / v).glob("*/generation_config.json"))
# written with use_diff=False (every field, nulls included): read back to the same settings, not the same text
FULL = {"full"}


def test_the_fixtures_are_there():
    assert {(p.parent.name, p.name) for p in FILES} == {
        (v, n) for v in VERSIONS for n in ("beam", "custom_keys", "from_model_config", "full", "sampling")}


def _settings(path: Path) -> dict:
    """What transformers 5 reads from a file, without its version stamp."""
    d = transformers.GenerationConfig.from_pretrained(path).to_dict()
    d.pop("transformers_version")
    return d


@pytest.mark.parametrize("folder", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_round_trip_writes_the_file_back(tmp_path, folder):
    original = (folder / "generation_config.json").read_text(encoding="utf-8")
    config = GenerationConfig.from_pretrained(folder)
    config.save_pretrained(tmp_path)
    written = (tmp_path / "generation_config.json").read_text(encoding="utf-8")
    if folder.name in FULL:  # what transformers 5 writes back: the nulls (= unset) left out
        transformers.GenerationConfig.from_pretrained(folder).save_pretrained(tmp_path / "hf")
        ref = json.loads((tmp_path / "hf" / "generation_config.json").read_text(encoding="utf-8"))
        ref["transformers_version"] = json.loads(original)["transformers_version"]  # genkit keeps the file's
        assert json.loads(written) == ref
    else:
        assert written == original  # byte for byte: same keys, values, version stamp and layout
    assert _settings(tmp_path) == _settings(folder)
    # and a second round trip changes nothing
    GenerationConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "generation_config.json").read_text(encoding="utf-8") == written


@pytest.mark.parametrize("version", VERSIONS)
def test_custom_keys_of_a_file_are_kept(version):
    config = GenerationConfig.from_pretrained(FIXTURES / version / "custom_keys")
    assert config.custom_entries() == {"chat_format": "chatml", "trust_remote_code": True}
    assert config.transformers_version == version.split("-")[1]


@pytest.mark.parametrize("name", ["sampling", "beam", "full", "from_model_config"])
@pytest.mark.parametrize("version", VERSIONS)
def test_same_tokens_as_transformers_with_the_file(tiny_pair, version, name):
    """The file as a model's generation config: the effective values at generate time are
    transformers 5's (sampling under the same seed, beams, the defaults of a full dump)."""
    hf, ours = tiny_pair
    folder = FIXTURES / version / name
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = {"max_new_tokens": 6, "attention_mask": torch.ones_like(ids)}
    hf_config = transformers.GenerationConfig.from_pretrained(folder)
    our_config = GenerationConfig.from_pretrained(folder)
    if name == "beam":  # transformers cannot use the sequence_bias it wrote (string keys); give it tuples
        hf_config.sequence_bias = {tuple(json.loads(k.replace("(", "[").replace(",)", "]").replace(")", "]"))): v
                                   for k, v in hf_config.sequence_bias.items()}
    torch.manual_seed(7)
    ref = hf.generate(ids, generation_config=hf_config, **kw)
    torch.manual_seed(7)
    got = ours.generate(ids, generation_config=our_config, **kw)
    assert torch.equal(got, ref)


# -- from_pretrained loader options ----------------------------------------------------------------

def test_unknown_loader_kwargs_are_ignored_and_returned_as_unused(tmp_path, caplog):
    GenerationConfig(max_new_tokens=5).save_pretrained(tmp_path)
    config, unused = GenerationConfig.from_pretrained(
        tmp_path, return_unused_kwargs=True, top_k=3, foo=1, trust_remote_code=True, mirror="x",
        resume_download=True, _from_auto=True, local_files_only=True, proxies={"http": "127.0.0.1:9"})
    assert config.top_k == 3 and config.max_new_tokens == 5
    assert unused == {"foo": 1}
    assert config.custom_entries() == {}  # loader options never become config entries
    config = GenerationConfig.from_pretrained(tmp_path, foo=1, temprature=0.3)  # ignored, not an error
    assert config.custom_entries() == {} and config.temperature is None
    assert "Did you mean `temperature`?" in caplog.text


def _publish(hub, repo_id: str, data: dict) -> None:
    hub.state.commit(repo_id, {"generation_config.json": json.dumps(data)})


def test_local_files_only_reads_only_the_cache(hub_server, tmp_path):
    _publish(hub_server, "org/cfg", {"do_sample": True, "top_p": 0.8})
    with pytest.raises(Exception) as err:  # nothing cached yet
        GenerationConfig.from_pretrained("org/cfg", local_files_only=True)
    assert "local" in type(err.value).__name__.lower() or "cache" in str(err.value).lower()
    assert GenerationConfig.from_pretrained("org/cfg").top_p == 0.8  # downloads
    hub_server.stop()
    assert GenerationConfig.from_pretrained("org/cfg", local_files_only=True).top_p == 0.8


class _Proxy(http.server.ThreadingHTTPServer):
    """A forward HTTP proxy that records the URLs it is asked for; one whose path matches ``hold`` waits
    (at most 60 s) for ``release`` before it is forwarded."""

    def __init__(self, hold: str | None = None) -> None:
        self.seen: list[str] = []
        self.hold, self.release = hold, threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _forward(self) -> None:
                proxy.seen.append(self.path)
                if proxy.hold is not None and proxy.hold in self.path:
                    proxy.release.wait(60)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "proxy-connection")}
                req = urllib.request.Request(self.path, data=body, headers=headers, method=self.command)
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                try:
                    resp = opener.open(req, timeout=10)
                except urllib.error.HTTPError as exc:
                    resp = exc
                data = resp.read()
                self.send_response(resp.status if hasattr(resp, "status") else resp.code)
                for k, v in resp.headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = resp.headers.get("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                try:
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a download stopped at its limit)

            do_GET = do_HEAD = do_POST = _forward

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_proxies_route_the_download_through_the_proxy(hub_server):
    _publish(hub_server, "org/proxied", {"max_new_tokens": 11})
    proxy = _Proxy()
    try:
        config = GenerationConfig.from_pretrained("org/proxied", proxies={"http": f"127.0.0.1:{proxy.server_port}"})
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert config.max_new_tokens == 11
    assert any("org/proxied" in url and url.startswith(hub_server.endpoint) for url in proxy.seen), proxy.seen
    # afterwards the client is direct again
    _publish(hub_server, "org/direct", {"max_new_tokens": 12})
    assert GenerationConfig.from_pretrained("org/direct").max_new_tokens == 12
    with pytest.raises(ValueError, match="`proxies` must be a dict"):
        GenerationConfig.from_pretrained("org/direct", proxies="127.0.0.1:1", force_download=True)


def test_proxies_are_the_calls_own(hub_server):
    """A download through ``proxies`` leaves the Hub client's other requests meanwhile (another thread's)
    direct, and keeps the client's session (it had swapped the process-wide client factory for the call:
    other threads' requests went through the proxy, and the shared session was closed twice)."""
    import time

    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import get_session

    _publish(hub_server, "org/proxied", {"max_new_tokens": 11})
    _publish(hub_server, "org/direct", {"max_new_tokens": 12})
    session = get_session()
    proxy = _Proxy(hold="org/proxied")
    got: list = []
    thread = threading.Thread(target=lambda: got.append(GenerationConfig.from_pretrained(
        "org/proxied", proxies={"http": f"127.0.0.1:{proxy.server_port}"})), daemon=True)
    try:
        thread.start()
        until = time.monotonic() + 60
        while not proxy.seen:  # the proxied download is under way, held at the proxy
            assert thread.is_alive() and time.monotonic() < until
            time.sleep(0.02)
        with open(hf_hub_download("org/direct", "generation_config.json"), encoding="utf-8") as f:
            assert json.loads(f.read())["max_new_tokens"] == 12
        assert thread.is_alive()
    finally:
        proxy.release.set()
        thread.join(60)
        proxy.shutdown()
        proxy.server_close()
    assert got and got[0].max_new_tokens == 11
    assert proxy.seen and all("org/proxied" in url for url in proxy.seen), proxy.seen
    assert any(p.startswith("/org/direct/") for _, p in hub_server.state.log)  # the other request went direct
    assert get_session() is session and not session.is_closed


def test_a_download_through_proxies_keeps_its_limit(hub_server, monkeypatch):
    import time

    from genkit.errors import ModelLoadError

    monkeypatch.setenv("GENKIT_MODEL_DOWNLOAD_TIMEOUT", "2")
    _publish(hub_server, "org/slow", {"max_new_tokens": 11})  # its body at 0.2 s a byte: 4 s and more
    hub_server.state.drip_next(1, 0.2, match=r"GET /org/slow/resolve/")
    proxy = _Proxy()
    start = time.monotonic()
    try:
        with pytest.raises(ModelLoadError, match=r"GET /org/slow/resolve/main/generation_config.json stopped: the "
                                                 r"download of generation_config.json of org/slow did not finish "
                                                 r"within 2 s \(GENKIT_MODEL_DOWNLOAD_TIMEOUT\)"):
            GenerationConfig.from_pretrained("org/slow", proxies={"http": f"127.0.0.1:{proxy.server_port}"})
        assert time.monotonic() - start < 2 + 2
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert proxy.seen and all("org/slow" in url for url in proxy.seen), proxy.seen


def test_save_pretrained_push_to_hub_takes_the_repo_id_from_the_folder_name(hub_server, tmp_path):
    config = GenerationConfig(do_sample=True, top_p=0.7)
    path = config.save_pretrained(tmp_path / "my-gen-config", push_to_hub=True)
    assert Path(path).read_text(encoding="utf-8") == config.to_json_string()
    from hub_server import USER

    repo = hub_server.state.repo(f"{USER}/my-gen-config")  # the folder's name, in the user's namespace
    assert repo.commits[repo.branches["main"]].files["generation_config.json"].decode() == config.to_json_string()
    # an explicit repo_id wins; the file reads back through from_pretrained
    config.save_pretrained(tmp_path / "elsewhere", push_to_hub=True, repo_id="org/chosen",
                           commit_message="chosen")
    shutil.rmtree(tmp_path / "elsewhere")
    assert GenerationConfig.from_pretrained("org/chosen").top_p == 0.7
    with pytest.raises(ValueError, match="only apply with push_to_hub=True"):
        config.save_pretrained(tmp_path / "x", repo_id="org/x")


def test_from_model_config_as_transformers():
    model_config = transformers.LlamaConfig(bos_token_id=5, eos_token_id=6, pad_token_id=7)
    ours = GenerationConfig.from_model_config(model_config)
    ref = transformers.GenerationConfig.from_model_config(model_config)
    drop = ("transformers_version",)
    assert {k: v for k, v in ours.to_diff_dict().items() if k not in drop} == \
        {k: v for k, v in ref.to_diff_dict().items() if k not in drop}


def test_set_seed_seeds_what_transformers_seeds():
    import random

    import numpy as np

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    transformers.set_seed(1234)
    ref = draws()
    genkit.set_seed(1234)
    assert draws() == ref
    genkit.set_seed(99)
    assert draws() != ref
    with pytest.raises(ValueError, match=r"`seed` must be an int in \[0, 2\*\*32\)"):
        genkit.set_seed(-1)


def test_a_deeply_nested_file_is_a_config_error_naming_it(tmp_path):
    """json's RecursionError escaped from GenerationConfig.from_pretrained (and load_model)"""
    from genkit.errors import ConfigError
    path = tmp_path / "generation_config.json"
    path.write_text('{"temperature": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=rf"{path} is not valid JSON: nested too deeply"):
        GenerationConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(("text", "message"), [
    ('{"temperature": NaN, "do_sample": true}', "`temperature` must be a finite number >= 0 (>= 1e-05 when sampling); got nan."),
    ('{"top_k": -3}', "`top_k` must be an int >= 0 (0 disables); got -3."),
    ('{"num_beams": 4, "num_return_sequences": 8}', "`num_return_sequences` (8) must be <= `num_beams` (4)."),
])
def test_a_bad_value_in_the_file_is_a_config_error_naming_the_file(tmp_path, text, message):
    """The error named the field but not the file it came from (a model folder's, a Hub repo's)."""
    from genkit.errors import ConfigError
    path = tmp_path / "generation_config.json"
    path.write_text(text)
    for load in (lambda: GenerationConfig.from_pretrained(tmp_path), lambda: GenerationConfig.from_pretrained(path),
                 lambda: GenerationConfig.from_json_file(path)):
        with pytest.raises(ConfigError) as exc:
            load()
        assert str(exc.value) == f"{path}: {message}"


def test_a_bad_override_of_a_good_file_is_the_callers_error(tmp_path):
    from genkit.errors import ConfigError
    (tmp_path / "generation_config.json").write_text('{"top_k": 5}')
    with pytest.raises(ConfigError) as exc:
        GenerationConfig.from_pretrained(tmp_path, top_k=-1)
    assert str(exc.value) == "`top_k` must be an int >= 0 (0 disables); got -1."
    config, unused = GenerationConfig.from_pretrained(tmp_path, top_p=0.5, foo=1, return_unused_kwargs=True)
    assert (config.top_k, config.top_p, unused) == (5, 0.5, {"foo": 1})
    assert config._loaded_hash == hash(config)  # saved back as loaded: validated leniently, as from_dict does


def test_load_model_names_the_generation_config_file(tmp_path, tiny_hf_dir):
    from genkit.errors import ConfigError
    folder = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, folder)
    (folder / "generation_config.json").write_text('{"top_k": -3}')
    with pytest.raises(ConfigError) as exc:
        genkit.load_model(folder)
    assert str(exc.value) == f"{folder / 'generation_config.json'}: `top_k` must be an int >= 0 (0 disables); got -3."
