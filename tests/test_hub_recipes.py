# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""Hub recipes end to end, with the real huggingface_hub client against tests/hub_server.py:
publish -> generate(custom_generate="org/name"), revisions, the trust gate, offline reuse, retries
of server faults, concurrent loads, and a model repo whose custom_generate/ overrides generate."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hub_server import hub_server, write_recipe  # noqa: F401

import genkit
from genkit.cli import main as cli
from genkit.recipes import (
    RecipeFetchError,
    RecipeNotFoundError,
    RecipeTrustError,
    RecipeValidationError,
    clear_cache,
    load_recipe,
)

ECHO = '''
import genkit

VERSION = "{version}"


def generate(model, inputs=None, *, left_padding=None, **kwargs):
    """Runs genkit.generate itself and reports what it was given (a dict, not a tensor)."""
    out = genkit.generate(model, inputs, **kwargs)
    return {{"sequences": out, "left_padding": left_padding, "keys": sorted(kwargs), "version": VERSION,
             "inputs_given": inputs is not None}}
'''

SCRIPT = r"""
import json, sys, time
import genkit.recipes as r
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
rec = r.load_recipe(sys.argv[1], trust_remote_code=True)
print(json.dumps({"commit": rec.commit, "version": rec.module.VERSION, "hash": rec.content_hash}))
"""


def _echo_recipe(root: Path, version: str = "v1") -> Path:
    return write_recipe(root, {"custom_generate/generate.py": ECHO.format(version=version),
                               "custom_generate/requirements.txt": "torch>=2.0  # tensors\n"})


def _publish(tmp_path: Path, repo: str, version: str = "v1", revision: str | None = None) -> str:
    folder = _echo_recipe(tmp_path / f"src-{version}", version)
    argv = ["publish", str(folder), repo, "--no-smoke"] + (["--revision", revision] if revision else [])
    assert cli(argv) == 0
    return folder


def _snapshot_files(server_cache: Path) -> list[str]:
    if not server_cache.exists():
        return []
    return sorted(str(p.relative_to(server_cache)) for p in server_cache.rglob("*") if p.is_file())


def _cache() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


def test_publish_then_generate_on_native_model(hub_server, tmp_path, tiny_model, capsys):
    _publish(tmp_path, "org/echo")
    out = capsys.readouterr().out
    assert "published" in out and "org/echo@" in out
    repo = hub_server.state.repo("org/echo")
    readme = repo.commits[repo.branches["main"]].files["README.md"].decode()
    assert "custom_generate" in readme

    ids = torch.tensor([[1, 17, 42, 7]])
    result = genkit.generate(tiny_model, ids, custom_generate="org/echo", trust_remote_code=True,
                             max_new_tokens=5, left_padding=5)
    assert isinstance(result, dict)  # returned unchanged, whatever its type
    assert result["left_padding"] == 5  # an extra argument reaches the recipe
    assert result["inputs_given"] is True
    assert "custom_generate" not in result["keys"] and "trust_remote_code" not in result["keys"]
    reference = genkit.generate(tiny_model, ids, max_new_tokens=5)
    assert torch.equal(result["sequences"], reference)
    assert result["version"] == "v1"
    # the private module name never shows up as a public one; sys.path untouched
    assert not any(name in sys.modules for name in ("generate", "custom_generate"))


def test_revision_by_branch_tag_and_sha(hub_server, tmp_path, caplog):
    _publish(tmp_path, "org/rev", "v1")
    v1 = hub_server.state.repo("org/rev").branches["main"]
    _publish(tmp_path, "org/rev", "v2", revision="dev")
    repo = hub_server.state.repo("org/rev")
    v2 = repo.branches["dev"]
    assert v1 != v2 and repo.branches["main"] == v1
    hub_server.state.tag("org/rev", "stable", v1)

    with caplog.at_level("WARNING", logger="genkit.recipes"):
        dev = load_recipe("org/rev@dev", trust_remote_code=True)
    assert dev.module.VERSION == "v2" and dev.commit == v2
    assert f"org/rev@{v2}" in caplog.text  # says which commit ran and how to pin it
    assert load_recipe("org/rev", trust_remote_code=True).module.VERSION == "v1"
    assert load_recipe("org/rev@stable", trust_remote_code=True).commit == v1
    pinned = load_recipe(f"org/rev@{v1}", trust_remote_code=True)
    assert pinned.module.VERSION == "v1" and pinned.commit == v1
    assert load_recipe("org/rev", revision=v2, trust_remote_code=True).module.VERSION == "v2"
    with pytest.raises(RecipeNotFoundError, match="org/rev"):
        load_recipe("org/rev@nope", trust_remote_code=True)
    with pytest.raises(RecipeNotFoundError, match="org/missing"):
        load_recipe("org/missing", trust_remote_code=True)


def test_second_load_makes_no_download_and_works_offline(hub_server, tmp_path):
    _publish(tmp_path, "org/off")
    first = load_recipe("org/off", trust_remote_code=True)
    assert hub_server.state.file_requests(), "the first load downloads"
    hub_server.state.log.clear()
    again = load_recipe("org/off", trust_remote_code=True)
    assert again.commit == first.commit
    assert hub_server.state.file_requests() == []  # no download
    assert [p for _, p in hub_server.state.log if "/revision/" not in p] == []
    hub_server.state.log.clear()
    pinned = load_recipe(f"org/off@{first.commit}", trust_remote_code=True)
    assert pinned.commit == first.commit and hub_server.state.log == []  # a sha needs no request at all

    hub_server.stop()  # nothing to talk to: offline must use the cache alone, in a fresh process
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "org/off", "0"], env=env, capture_output=True, check=False,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["commit"] == first.commit


def test_without_trust_nothing_is_requested_or_written(hub_server, tmp_path, monkeypatch, tiny_model):
    _publish(tmp_path, "org/untrusted")
    hub_server.state.log.clear()
    cache_before = _snapshot_files(_cache())
    with pytest.raises(RecipeTrustError) as err:
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="org/untrusted")
    msg = str(err.value)
    assert "trust_remote_code=True" in msg and "GENKIT_TRUSTED_REPOS" in msg and "genkit inspect" in msg
    assert hub_server.state.requested(".py") == []
    assert hub_server.state.file_requests() == []
    assert hub_server.state.log == []  # refused before a single request
    assert _snapshot_files(_cache()) == cache_before  # nothing written to the cache
    assert not (_cache() / "models--org--untrusted").exists()

    # trusted-repos setting: globs, pins, and an explicit False wins
    monkeypatch.setenv("GENKIT_TRUSTED_REPOS", "other/x, org/*")
    assert load_recipe("org/untrusted").trusted_by == "trusted-repos entry 'org/*'"
    with pytest.raises(RecipeTrustError):
        load_recipe("org/untrusted", trust_remote_code=False)
    monkeypatch.setenv("GENKIT_TRUSTED_REPOS", "org/untrusted@" + "0" * 40)
    clear_cache()  # forget the resolution of 'main' the loads above made (reused for 60 s otherwise)
    hub_server.state.log.clear()
    with pytest.raises(RecipeTrustError, match="trust_remote_code=True"):
        load_recipe("org/untrusted")  # the name matches, so the commit is resolved, but it is not the pinned one
    assert [p for _, p in hub_server.state.log] == ["/api/models/org/untrusted/revision/main"]
    commit = hub_server.state.repo("org/untrusted").branches["main"]
    monkeypatch.delenv("GENKIT_TRUSTED_REPOS")
    home = Path(os.environ["GENKIT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "settings.json").write_text(json.dumps({"trusted_repos": [f"org/untrusted@{commit}"]}))
    assert load_recipe("org/untrusted").commit == commit


def test_server_errors_are_retried(hub_server, tmp_path, monkeypatch):
    _publish(tmp_path, "org/flaky")
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "4")
    hub_server.state.fail_next(2, 500, match=r"/revision/")
    hub_server.state.truncate_next(1, match=r"GET .*/resolve/.*generate\.py")
    rec = load_recipe("org/flaky", trust_remote_code=True)
    assert rec.module.VERSION == "v1"
    snap = _cache() / "models--org--flaky" / "snapshots" / rec.commit / "custom_generate" / "generate.py"
    assert snap.read_text() == ECHO.format(version="v1")


def test_timeouts_are_retried(hub_server, tmp_path, monkeypatch):
    _publish(tmp_path, "org/slow")
    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.5")
    hub_server.state.delay_next(1, 2.0, match=r"/revision/")
    t0 = time.time()
    assert load_recipe("org/slow", trust_remote_code=True).module.VERSION == "v1"
    assert time.time() - t0 < 30
    revision_calls = [p for _, p in hub_server.state.log if "/revision/" in p]
    assert len(revision_calls) >= 2
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "2")
    monkeypatch.setenv("GENKIT_RECIPE_RESOLVE_INTERVAL", "0")  # resolve 'main' again now (not in 60 s)
    hub_server.state.delay_next(100, 1.5, match=r"/revision/")
    with pytest.raises(RecipeFetchError, match=r"org/slow.*after 2 attempts.*Timeout"):
        load_recipe("org/slow", trust_remote_code=True)


def test_persistent_errors_name_the_repo_and_leave_no_module(hub_server, tmp_path, monkeypatch):
    _publish(tmp_path, "org/broken")
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "2")
    hub_server.state.fail_next(100, 500, match=r"/revision/")
    with pytest.raises(RecipeFetchError, match=r"org/broken.*after 2 attempts"):
        load_recipe("org/broken", trust_remote_code=True)
    hub_server.state.faults.clear()
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "1")  # huggingface_hub itself resumes 5 times, 1 s apart
    hub_server.state.truncate_next(100, match=r"GET .*/resolve/.*generate\.py")
    with pytest.raises(RecipeFetchError, match="org/broken"):
        load_recipe("org/broken", trust_remote_code=True)
    commit = hub_server.state.repo("org/broken").branches["main"]
    snap = _cache() / "models--org--broken" / "snapshots" / commit / "custom_generate" / "generate.py"
    assert not snap.exists()  # never a half-written module
    assert not (Path(os.environ["GENKIT_HOME"]) / "recipes" / "manifests" / "org--broken").exists()
    hub_server.state.faults.clear()
    assert load_recipe("org/broken", trust_remote_code=True).module.VERSION == "v1"


def test_two_processes_load_the_same_recipe_at_once(hub_server, tmp_path):
    _publish(tmp_path, "org/race")
    start = str(time.time() + 4.0)  # both wait for the same instant after importing
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, "org/race", start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    commit = results[0]["commit"]
    manifest = json.loads((Path(os.environ["GENKIT_HOME"]) / "recipes" / "manifests" / "org--race"
                           / f"{commit}.json").read_text())
    assert manifest["commit"] == commit
    snap = _cache() / "models--org--race" / "snapshots" / commit
    assert (snap / "custom_generate" / "generate.py").read_text() == ECHO.format(version="v1")
    assert not list(_cache().rglob("*.incomplete"))


def test_hub_listing_is_checked_before_download(hub_server, monkeypatch):
    big = "def generate(model):\n    return 1\n" + "# padding\n" * 200_000
    hub_server.state.commit("org/huge", {"custom_generate/generate.py": big, "README.md": "x"})
    with pytest.raises(RecipeValidationError, match="over the"):
        load_recipe("org/huge", trust_remote_code=True)
    assert hub_server.state.file_requests() == []
    hub_server.state.commit("org/odd", {"custom_generate/generate.py": "def generate(model):\n    pass\n",
                                        "custom_generate/ütil.py": "X = 1\n"})
    with pytest.raises(RecipeValidationError, match="not ASCII"):
        load_recipe("org/odd", trust_remote_code=True)
    hub_server.state.commit("org/sib", {"custom_generate/generate.py": "import helpers\n\ndef generate(model):\n"
                                                                       "    pass\n", "helpers.py": "X = 1\n"})
    with pytest.raises(RecipeValidationError, match=r"generate.py:1: import of `helpers`"):
        load_recipe("org/sib", trust_remote_code=True)
    hub_server.state.commit("org/none", {"README.md": "no recipe here"})
    with pytest.raises(RecipeValidationError, match="no custom_generate/generate.py"):
        load_recipe("org/none", trust_remote_code=True)
    assert hub_server.state.file_requests() == [] or all("sib" in p for _, p in hub_server.state.file_requests())


def test_model_repo_with_recipe_overrides_generate(hub_server, tmp_path, tiny_model):
    from safetensors.torch import save_file

    folder = tmp_path / "model_repo"
    write_recipe(folder, {"custom_generate/generate.py": ECHO.format(version="model-recipe")})
    from genkit.models.tiny import TINY_LLAMA

    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_file({k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(folder / "model.safetensors"))
    from huggingface_hub import HfApi

    HfApi().create_repo("org/model")
    HfApi().upload_folder(repo_id="org/model", folder_path=str(folder))

    plain = genkit.load_model("org/model")
    ids = torch.tensor([[1, 17, 42, 7]])
    assert isinstance(plain.generate(ids, max_new_tokens=3), torch.Tensor)  # not trusted: built-in generate
    assert hub_server.state.requested(".py") == []

    model = genkit.load_model("org/model", trust_remote_code=True)
    out = model.generate(ids, max_new_tokens=4, left_padding=3)
    assert isinstance(out, dict) and out["version"] == "model-recipe" and out["left_padding"] == 3
    assert torch.equal(out["sequences"], genkit.generate(tiny_model, ids, max_new_tokens=4))


def test_cli_inspect_hub_reads_without_writing(hub_server, tmp_path, capsys):
    write_recipe(tmp_path / "risky", {
        "custom_generate/generate.py": "import subprocess\nfrom .util import helper\n\n"
                                       "def generate(model, **kw):\n    return eval('1')\n",
        "custom_generate/util.py": "import pickle\n\ndef helper():\n    return pickle.loads(b'')\n",
        "custom_generate/requirements.txt": "torch>=2.0\nnot-a-real-package-xyz>=1.0\n",
    }, readme="---\ntags: [custom_generate]\n---\n\n# Risky\n\nDoes risky things on purpose.\n")
    from huggingface_hub import HfApi

    HfApi().create_repo("org/risky")
    HfApi().upload_folder(repo_id="org/risky", folder_path=str(tmp_path / "risky"))
    capsys.readouterr()
    before = {k for k in sys.modules if k.startswith("_genkit_recipe_")}
    assert cli(["inspect", "org/risky"]) == 0
    out = capsys.readouterr().out
    assert "Does risky things on purpose." in out
    assert "custom_generate/generate.py:1: [process] import subprocess" in out
    assert "custom_generate/generate.py:5: [dynamic code] call eval()" in out
    assert "custom_generate/util.py:4: [deserialization] call pickle.loads()" in out
    assert "UNMET not-a-real-package-xyz>=1.0 (installed: None)" in out
    assert not (_cache() / "models--org--risky").exists()  # nothing written, nothing imported
    assert {k for k in sys.modules if k.startswith("_genkit_recipe_")} == before
    assert cli(["inspect", "org/risky", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["requirements_ok"] is False and data["front_matter"]["tags"] == ["custom_generate"]


def test_cli_publish_private_branch_and_refusal(hub_server, tmp_path, capsys):
    folder = write_recipe(tmp_path / "untagged", {"custom_generate/generate.py": ECHO.format(version="p")},
                          readme="# Untagged\n\nNo front matter yet.\n")
    assert cli(["publish", str(folder), "me/priv", "--private", "--revision", "exp"]) == 0
    repo = hub_server.state.repo("me/priv")
    assert repo.private and "exp" in repo.branches
    readme = repo.commits[repo.branches["exp"]].files["README.md"].decode()
    assert readme.startswith("---\n") and "custom_generate" in readme and "No front matter yet." in readme
    assert "custom_generate/generate.py" in repo.commits[repo.branches["exp"]].files

    bad = write_recipe(tmp_path / "bad", {"custom_generate/generate.py": "def generate(x):\n    pass\n"})
    capsys.readouterr()
    assert cli(["publish", str(bad), "me/bad"]) == 1
    assert "first parameter of generate() must be `model`" in capsys.readouterr().err
    assert hub_server.state.repo("me/bad") is None  # nothing uploaded


@pytest.mark.parametrize(("args", "why"), [
    (["a--b/c"], "repo id 'a--b/c' must look like 'org/name'"),
    (["me/x", "--revision", "../main"], "`revision` \\(the branch to publish to\\) '../main' is not a valid git revision"),
    (["me/x", "--revision", "a b"], "is not a valid git revision"),
])
def test_cli_publish_refuses_bad_names_before_any_request(hub_server, tmp_path, capsys, args, why):
    folder = write_recipe(tmp_path / "ok", {"custom_generate/generate.py": ECHO.format(version="p")})
    assert cli(["publish", str(folder), *args, "--no-smoke"]) != 0
    assert re.search(why, capsys.readouterr().err)
    assert not [p for _, p in hub_server.state.log if "/api/agent" not in p]


def test_publish_upload_failure_is_a_fetch_error(hub_server, tmp_path):
    from genkit.recipes import RecipeFetchError
    from genkit.recipes.publish import publish_recipe

    folder = write_recipe(tmp_path / "ok", {"custom_generate/generate.py": ECHO.format(version="p")})
    hub_server.state.fail_next(1, status=403, match="/commit/")
    with pytest.raises(RecipeFetchError, match=r"uploading .*ok to 'me/up' on http://127\.0\.0\.1:\d+ failed: .*403"):
        publish_recipe(folder, "me/up")
