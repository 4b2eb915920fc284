# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""Hostile recipes and hostile settings against the loader (issue #11), classes 1, 2, 3 and 7:
what is checked is what runs (encodings), revisions validated before any path is built, trust
settings that fail closed, shell-quoted hints, and recipes that change the import system.

Hub cases go through the real huggingface_hub client against tests/hub_server.py."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hub_server import hub_server, write_recipe  # noqa: F401

import genkit
from genkit.cli import main as cli
from genkit.errors import ConfigError
from genkit.generation.smoke import smoke_run
from genkit.recipes import RecipeNotFoundError, RecipeTrustError, RecipeValidationError, load_recipe
from genkit.recipes.check import check_recipe

PLAIN = "def generate(model, inputs=None, **kwargs):\n    return 'plain'\n"

# 'x = 1' as the UTF-8 text every check sees; in UTF-7, the comment's '+AAo-...' decodes to a newline
# followed by code, which Python would run if it compiled the bytes and obeyed the declaration
UTF7_HIDDEN = (b"# -*- coding: utf-7 -*-\n"
               b"def generate(model, inputs=None, **kwargs):\n"
               b"    return 'checked'  # +AAoAIAAgACAAIAByAGUAdAB1AHIAbgAgACcAaABpAGQAZABlAG4AJw-\n")


def _recipe(tmp_path: Path, name: str, generate: str | bytes, **more: str | bytes) -> Path:
    files: dict[str, str | bytes] = {"custom_generate/generate.py": generate}
    files.update({f"custom_generate/{k}": v for k, v in more.items()})
    return write_recipe(tmp_path / name, files)


def _cache() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


# -- class 1: the text checked is the text executed ----------------------------------------------
@pytest.mark.parametrize("coding", [b"utf-7", b"latin-1", b"utf-16", b"cp1252"])
def test_non_utf8_encoding_declaration_is_refused(tmp_path, coding):
    src = UTF7_HIDDEN.replace(b"utf-7", coding)
    root = _recipe(tmp_path, "enc", src)
    with pytest.raises(RecipeValidationError, match=rf"generate.py:1: encoding declaration '{coding.decode()}'"):
        load_recipe(str(root))


def test_encoding_declaration_in_a_helper_module_is_refused(tmp_path):
    root = _recipe(tmp_path, "helper", "from .util import X\n" + PLAIN,
                   **{"util.py": b"# vim: set fileencoding=utf-7 :\nX = 1\n"})
    with pytest.raises(RecipeValidationError, match=r"util.py:1: encoding declaration 'utf-7'"):
        load_recipe(str(root))


@pytest.mark.parametrize("decl", [b"# -*- coding: utf-8 -*-\n", b"#!/usr/bin/env python\n# coding=utf8\n", b""])
def test_utf8_declarations_and_a_bom_are_accepted(tmp_path, tiny_model, decl):
    for bom in (b"", b"\xef\xbb\xbf"):
        root = _recipe(tmp_path, f"ok{len(decl)}{len(bom)}", bom + decl + PLAIN.encode())
        assert genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate=str(root)) == "plain"


def test_a_declaration_after_code_is_not_a_declaration(tmp_path, tiny_model):
    # PEP 263 only reads lines 1-2; a 'coding: utf-7' comment on line 3 is a plain comment
    root = _recipe(tmp_path, "late", b"X = 1\n\n# coding: utf-7\n" + PLAIN.encode())
    assert genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate=str(root)) == "plain"


def test_hub_recipe_with_utf7_declaration_is_refused_before_import(hub_server, tiny_model):
    hub_server.state.commit("org/utf7", {"custom_generate/generate.py": UTF7_HIDDEN,
                                         "README.md": "---\ntags: [custom_generate]\n---\n"})
    before = {k for k in sys.modules if k.startswith("_genkit_recipe_")}
    with pytest.raises(RecipeValidationError, match="encoding declaration 'utf-7'"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="org/utf7", trust_remote_code=True)
    assert {k for k in sys.modules if k.startswith("_genkit_recipe_")} == before


# -- class 2: revisions are validated before any path is built -----------------------------------
BAD_REVISIONS = ["../../x", "..", "a/../../b", "refs/../../../etc", "/abs", "x/", "a//b", ".hidden", "x.lock",
                 "a b", "a\tb", "a:b", "a~1", "a^", "a?", "a*", "a[0]", "a\\b", "@", "x@{1}", "x.", "\x00x",
                 "v" * 300]


@pytest.mark.parametrize("rev", BAD_REVISIONS)
def test_bad_revisions_are_refused_before_any_request(hub_server, rev):
    with pytest.raises(ValueError, match="is not a valid git revision|must be a non-empty"):
        load_recipe(f"org/r@{rev}", trust_remote_code=True)
    with pytest.raises(ValueError, match="is not a valid git revision|must be a non-empty"):
        load_recipe("org/r", revision=rev, trust_remote_code=True)
    assert hub_server.state.requested() == [] or all("/api/agent" in p for _, p in hub_server.state.requested())
    assert not _cache().exists() or not any(_cache().rglob("*x*"))


def test_offline_ref_file_must_hold_a_sha(hub_server, tmp_path, monkeypatch):
    # an attacker-writable ref file pointing at a folder of their own is not followed
    store = _cache() / "models--org--off"
    (store / "refs").mkdir(parents=True)
    (store / "refs" / "main").write_text("../../../../" + str(tmp_path / "evil"))
    evil = _recipe(tmp_path, "evil", "def generate(model, **kw):\n    return 'evil'\n")
    assert evil.is_dir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError, match="does not hold a 40-hex commit sha"):
        load_recipe("org/off", trust_remote_code=True)


def test_offline_ref_file_symlinked_out_of_refs_is_refused(hub_server, tmp_path, monkeypatch):
    store = _cache() / "models--org--off2"
    (store / "refs").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "main").write_text("a" * 40)
    os.symlink(outside, store / "refs" / "dev")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError, match="leaves the Hub cache's refs/ folder"):
        load_recipe("org/off2@dev/main", trust_remote_code=True)


def test_branch_names_with_slashes_still_work(hub_server, tiny_model, tmp_path):
    sha = hub_server.state.commit("org/br", {"custom_generate/generate.py": PLAIN,
                                             "README.md": "---\ntags: [custom_generate]\n---\n"},
                                  branch="feature/x")
    recipe = load_recipe("org/br@feature/x", trust_remote_code=True)
    assert recipe.commit == sha
    assert (_cache() / "models--org--br" / "refs" / "feature" / "x").read_text() == sha


# -- class 3: trust settings fail closed ---------------------------------------------------------
@pytest.mark.parametrize("value", ["org/r@", "org/r@main", "org/r@abc123", "org", "org/r/x", "*/*", "org/r@" + "A" * 40,
                                   "org/r@@" + "a" * 40])
def test_bad_trusted_repos_entries_are_errors(hub_server, monkeypatch, value):
    monkeypatch.setenv("GENKIT_TRUSTED_REPOS", value)
    with pytest.raises(ValueError, match="GENKIT_TRUSTED_REPOS: trusted-repos entry " + re.escape(repr(value))
                       + " is not accepted"):
        load_recipe("org/r")
    monkeypatch.delenv("GENKIT_TRUSTED_REPOS")
    settings = Path(os.environ["GENKIT_HOME"]) / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"trusted_repos": [value]}))
    with pytest.raises(ValueError, match=r"`trusted_repos` in .*settings.json: trusted-repos entry"):
        load_recipe("org/r")
    assert hub_server.state.file_requests() == []


def test_empty_pin_no_longer_trusts_every_commit(hub_server, monkeypatch):
    hub_server.state.commit("org/pin", {"custom_generate/generate.py": PLAIN,
                                        "README.md": "---\ntags: [custom_generate]\n---\n"})
    monkeypatch.setenv("GENKIT_TRUSTED_REPOS", "org/pin@")
    with pytest.raises(ValueError, match="an empty or partial pin like 'org/name@' is refused"):
        load_recipe("org/pin")
    assert hub_server.state.file_requests() == []


@pytest.mark.parametrize("value", ["2", "maybe", "", "tru", "O"])
def test_unknown_local_trust_values_are_errors(tmp_path, monkeypatch, value):
    root = _recipe(tmp_path, "local", PLAIN)
    monkeypatch.setenv("GENKIT_TRUST_LOCAL_RECIPES", value)
    with pytest.raises(ValueError, match=rf"GENKIT_TRUST_LOCAL_RECIPES={value!r} is not accepted; use one of 1, on, "
                                         "true, yes .* or 0, false, no, off"):
        load_recipe(str(root))


@pytest.mark.parametrize("value", ["no", 0, "false", None, [False]])
def test_non_boolean_trust_local_recipes_setting_is_an_error(tmp_path, monkeypatch, value):
    root = _recipe(tmp_path, "local", PLAIN)
    home = tmp_path / "home"
    home.mkdir()
    (home / "settings.json").write_text(json.dumps({"trust_local_recipes": value}))
    monkeypatch.setenv("GENKIT_HOME", str(home))
    monkeypatch.delenv("GENKIT_TRUST_LOCAL_RECIPES", raising=False)
    with pytest.raises(ValueError, match=r"`trust_local_recipes` in .*settings.json must be true or false"):
        load_recipe(str(root))


def test_check_honours_local_trust_before_its_smoke_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    root = _recipe(tmp_path, "smoke", f"open({str(marker)!r}, 'w').close()\n" + PLAIN)
    monkeypatch.setenv("GENKIT_TRUST_LOCAL_RECIPES", "0")
    report = check_recipe(root, smoke=smoke_run)
    assert report.smoke == "not run (needs trust)" and not marker.exists()
    assert any("--trust-remote-code" in w for w in report.warnings)
    trusted = check_recipe(root, smoke=smoke_run, trust_remote_code=True)
    assert marker.exists() and trusted.smoke.startswith("returned")


def test_check_cli_flag_gives_the_smoke_run_trust(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "ran"
    root = _recipe(tmp_path, "smoke", f"open({str(marker)!r}, 'w').close()\n" + PLAIN)
    monkeypatch.setenv("GENKIT_TRUST_LOCAL_RECIPES", "0")
    cli(["check", str(root)])
    assert not marker.exists() and "smoke run skipped" in capsys.readouterr().out
    cli(["check", str(root), "--trust-remote-code"])
    assert marker.exists()


def test_untrusted_local_recipe_writes_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    root = _recipe(tmp_path, "strict", f"open({str(marker)!r}, 'w').close()\n" + PLAIN)
    monkeypatch.setenv("GENKIT_TRUST_LOCAL_RECIPES", "off")
    with pytest.raises(RecipeTrustError):
        load_recipe(str(root))
    assert not marker.exists()


# -- class 7: the install hint is shell-quoted; the import system is restored ------------------
def test_install_hint_is_shell_quoted(tmp_path):
    root = _recipe(tmp_path, "req", PLAIN, **{"requirements.txt": "not-a-real-package-xyz>=1.0\ntorch>=999\n"})
    with pytest.raises(ImportError) as err:
        load_recipe(str(root))
    lines = str(err.value).splitlines()
    assert lines[0] == f"Missing requirements in your local environment for `{root}`:"
    assert lines[-1].endswith("install them with: pip install 'not-a-real-package-xyz>=1.0' 'torch>=999')")


@pytest.mark.parametrize("change", [
    "import sys\nsys.path.insert(0, '/tmp/evil-site')\n",
    "import sys\nsys.path.append('/tmp/evil-site')\n",
    "import sys\nsys.path[:] = []\n",
    "import sys\nclass F:\n    def find_spec(self, *a):\n        return None\nsys.meta_path.insert(0, F())\n",
    "import sys\nsys.meta_path.pop()\n",
])
def test_import_system_changes_are_undone_with_a_warning(tmp_path, tiny_model, caplog, change):
    path, meta = list(sys.path), list(sys.meta_path)
    root = _recipe(tmp_path, "sys", change + PLAIN)
    with caplog.at_level(logging.WARNING, logger="genkit.sandbox"):
        assert genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate=str(root)) == "plain"
    assert sys.path == path
    assert sys.meta_path[-len(meta):] == meta and len(sys.meta_path) == len(meta) + (sys.meta_path[0] not in meta)
    assert any("while being imported" in r.getMessage() and "the change was undone" in r.getMessage()
               for r in caplog.records)


def test_import_system_restored_when_the_import_fails(tmp_path):
    path = list(sys.path)
    root = _recipe(tmp_path, "boom", "import sys\nsys.path.insert(0, '/tmp/evil')\nraise RuntimeError('boom')\n"
                   + PLAIN)
    with pytest.raises(ImportError, match="boom"):
        load_recipe(str(root))
    assert sys.path == path


# -- no network per call ---------------------------------------------------------------------------
def test_a_recipe_called_in_a_loop_asks_the_hub_at_most_twice(hub_server, tiny_model, monkeypatch):
    sha = hub_server.state.commit("org/loop", {"custom_generate/generate.py": PLAIN,
                                               "README.md": "---\ntags: [custom_generate]\n---\n"})
    ids = torch.tensor([[1, 2]])
    assert genkit.generate(tiny_model, ids, custom_generate="org/loop", trust_remote_code=True) == "plain"
    hub_server.state.log.clear()
    for _ in range(100):
        assert genkit.generate(tiny_model, ids, custom_generate="org/loop", trust_remote_code=True) == "plain"
    assert len(hub_server.state.log) <= 2
    # trust is still checked on every call
    with pytest.raises(RecipeTrustError):
        genkit.generate(tiny_model, ids, custom_generate="org/loop")
    # with the interval at 0 each call re-resolves 'main' (one request) but fetches nothing again
    monkeypatch.setenv("GENKIT_RECIPE_RESOLVE_INTERVAL", "0")
    hub_server.state.log.clear()
    for _ in range(3):
        assert load_recipe("org/loop", trust_remote_code=True).commit == sha
    assert [p for _, p in hub_server.state.log] == ["/api/models/org/loop/revision/main"] * 3
    # a new commit on the branch is picked up at the next resolution
    new = hub_server.state.commit("org/loop", {"custom_generate/generate.py": PLAIN.replace("plain", "new")})
    assert load_recipe("org/loop", trust_remote_code=True).commit == new
    assert genkit.generate(tiny_model, ids, custom_generate="org/loop", trust_remote_code=True) == "new"


def test_offline_calls_make_no_requests(hub_server, tiny_model, monkeypatch):
    hub_server.state.commit("org/offl", {"custom_generate/generate.py": PLAIN,
                                         "README.md": "---\ntags: [custom_generate]\n---\n"})
    ids = torch.tensor([[1, 2]])
    genkit.generate(tiny_model, ids, custom_generate="org/offl", trust_remote_code=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GENKIT_RECIPE_RESOLVE_INTERVAL", "0")
    hub_server.state.log.clear()
    for _ in range(5):
        assert genkit.generate(tiny_model, ids, custom_generate="org/offl", trust_remote_code=True) == "plain"
    assert hub_server.state.log == []


@pytest.mark.parametrize("value", ["-1", "soon", "nan"])
def test_bad_resolve_interval_is_an_error(hub_server, monkeypatch, value):
    hub_server.state.commit("org/iv", {"custom_generate/generate.py": PLAIN})
    monkeypatch.setenv("GENKIT_RECIPE_RESOLVE_INTERVAL", value)
    with pytest.raises(ValueError, match=rf"GENKIT_RECIPE_RESOLVE_INTERVAL='{value}' is not accepted"):
        load_recipe("org/iv", trust_remote_code=True)


# -- class 8: a relative folder that also reads as a Hub id -------------------------------------
def test_local_folder_named_like_a_hub_id_wins_and_says_so(tmp_path, tiny_model, monkeypatch, caplog):
    write_recipe(tmp_path / "org" / "repo", {"custom_generate/generate.py": PLAIN})
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="genkit.recipes"):
        assert genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="org/repo") == "plain"
    msgs = [r.getMessage() for r in caplog.records if "both a local folder" in r.getMessage()]
    assert msgs and "using the local folder" in msgs[0] and "'org/repo@main' for the Hub repo" in msgs[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="genkit.recipes"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="./org/repo")
    assert not [r for r in caplog.records if "both a local folder" in r.getMessage()]


# -- class 4: the cache is re-verified against the commit's listing on every load --------------------
def _hub_recipe(hub_server, repo: str, **files: str) -> str:
    content = {"custom_generate/generate.py": PLAIN, "README.md": "---\ntags: [custom_generate]\n---\n"}
    content.update({f"custom_generate/{k}": v for k, v in files.items()})
    return hub_server.state.commit(repo, content)


def test_tampered_cache_is_downloaded_again_online_and_refused_offline(hub_server, tiny_model, monkeypatch):
    from genkit.recipes import clear_cache

    sha = _hub_recipe(hub_server, "org/tamper")
    load_recipe(f"org/tamper@{sha}", trust_remote_code=True)
    cached = _cache() / "models--org--tamper" / "snapshots" / sha / "custom_generate" / "generate.py"
    evil = PLAIN.replace("'plain'", "'evil'")  # same length: a size check alone would not see it
    os.chmod(os.path.realpath(cached), 0o644)
    Path(os.path.realpath(cached)).write_text(evil)
    clear_cache()  # a new process, as far as the loader can tell
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError, match=r"does not match the commit's listing .*custom_generate/generate.py"):
        load_recipe(f"org/tamper@{sha}", trust_remote_code=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    ids = torch.tensor([[1, 2]])
    assert genkit.generate(tiny_model, ids, custom_generate=f"org/tamper@{sha}", trust_remote_code=True) == "plain"
    assert cached.read_text() == PLAIN


def test_files_not_in_the_commit_are_not_importable(hub_server, tiny_model, monkeypatch, caplog):
    from genkit.recipes import clear_cache

    sha = _hub_recipe(hub_server, "org/extra")
    load_recipe(f"org/extra@{sha}", trust_remote_code=True)
    folder = _cache() / "models--org--extra" / "snapshots" / sha / "custom_generate"
    (folder / "generate.py").unlink()  # a planted generate.py replaces the commit's; a helper sits beside it
    (folder / "generate.py").write_text("from .planted import X\n" + PLAIN.replace("'plain'", "X"))
    (folder / "planted.py").write_text("X = 'planted'\n")
    clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError):
        load_recipe(f"org/extra@{sha}", trust_remote_code=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with caplog.at_level(logging.WARNING, logger="genkit.recipes"):
        out = genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate=f"org/extra@{sha}",
                              trust_remote_code=True)
    assert out == "plain" and not (folder / "planted.py").exists()
    assert any("planted.py" in r.getMessage() and "not in the commit's listing" in r.getMessage()
               for r in caplog.records)


def test_planted_file_alone_is_refused_offline_and_removed_online(hub_server, monkeypatch):
    from genkit.recipes import clear_cache

    sha = _hub_recipe(hub_server, "org/plant")
    load_recipe(f"org/plant@{sha}", trust_remote_code=True)
    folder = _cache() / "models--org--plant" / "snapshots" / sha / "custom_generate"
    (folder / "sub").mkdir()
    (folder / "sub" / "x.py").write_text("Y = 1\n")
    clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError, match=r"holds files the commit does not: custom_generate/sub/x.py"):
        load_recipe(f"org/plant@{sha}", trust_remote_code=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    load_recipe(f"org/plant@{sha}", trust_remote_code=True)
    assert not (folder / "sub" / "x.py").exists()


# -- class 5: limits are enforced from the listing, before anything is downloaded -------------------
@pytest.mark.parametrize(("files", "why"), [
    ({f"m{i}.py": "X = 1\n" for i in range(300)}, r"the listing has 30\d recipe files, over the 256-file limit"),
    ({f"big{i}.txt": "x" * 999_000 for i in range(9)}, r"hold \d+ bytes, over the 8000000-byte limit"),
    ({"a" * 300 + ".py": "X = 1\n"}, r"is 303 characters long, over the 100-character limit"),
    ({"/".join(["d" * 90] * 6) + "/x.py": "X = 1\n"}, r"characters long, over the 512-character limit"),
])
def test_limits_are_checked_from_the_listing(hub_server, files, why):
    _hub_recipe(hub_server, "org/big", **files)
    hub_server.state.log.clear()
    with pytest.raises(RecipeValidationError, match=why):
        load_recipe("org/big", trust_remote_code=True)
    assert hub_server.state.file_requests() == []
    assert not (_cache() / "models--org--big" / "snapshots").exists()


def test_overlong_local_file_name_is_a_recipe_error(tmp_path):
    root = _recipe(tmp_path, "long", PLAIN)
    (root / "custom_generate" / ("b" * 200 + ".py")).write_text("X = 1\n")  # 204 bytes: ext4 and tmpfs allow 255
    with pytest.raises(RecipeValidationError, match="over the 100-character limit"):
        load_recipe(str(root))


# -- class 6: `genkit inspect` bounds what it reads and parses ---------------------------------------
ALIAS_BOMB = ("---\ntags: [custom_generate]\na: &a [x,x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
              "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
              "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
              "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f]\nh: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
              "i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h,*h]\ntags2: *i\n---\n# bomb\n")


def test_yaml_alias_bomb_in_front_matter_does_not_matter(hub_server, tmp_path, capsys):
    from genkit.recipes.validate import front_matter

    assert len(ALIAS_BOMB) < 700
    assert front_matter(ALIAS_BOMB) is None  # aliases are refused, not expanded
    assert front_matter("---\ntags: [custom_generate]\n---\n") == {"tags": ["custom_generate"]}
    hub_server.state.commit("org/bomb", {"custom_generate/generate.py": PLAIN, "README.md": ALIAS_BOMB})
    assert cli(["inspect", "org/bomb"]) == 0
    out = capsys.readouterr().out
    assert "README.md has no YAML front matter" in out and len(out) < 20_000
    local = write_recipe(tmp_path / "bomb", {"custom_generate/generate.py": PLAIN}, readme=ALIAS_BOMB)
    assert cli(["inspect", str(local)]) == 0
    assert len(capsys.readouterr().out) < 20_000


def test_inspect_stops_reading_a_body_longer_than_listed(hub_server):
    from genkit.recipes.inspection import inspect_recipe

    hub_server.state.commit("org/long", {"custom_generate/generate.py": PLAIN,
                                         "README.md": "---\ntags: [custom_generate]\n---\n"})
    hub_server.state.oversize_next(1, extra=50_000_000, match=r"generate\.py")
    with pytest.raises(RecipeValidationError, match="the Hub sent more than the .* bytes its listing gives"):
        inspect_recipe("org/long")


def test_inspect_does_not_read_an_oversized_readme(hub_server, capsys):
    hub_server.state.commit("org/bigreadme", {"custom_generate/generate.py": PLAIN,
                                              "README.md": "---\ntags: [custom_generate]\n---\n" + "x" * 400_000})
    hub_server.state.log.clear()
    assert cli(["inspect", "org/bigreadme"]) == 0
    out = capsys.readouterr().out
    assert "README.md: 400032 bytes, over the 256000-byte limit (not read)" in out and "README.md is missing" not in out
    assert not [p for _, p in hub_server.state.log if p.endswith("/README.md")]


def test_local_folder_limits_are_checked_before_reading(tmp_path):
    root = _recipe(tmp_path, "many", PLAIN)
    for i in range(300):
        (root / "custom_generate" / f"m{i}.txt").write_text("x")
    with pytest.raises(RecipeValidationError, match=r"custom_generate/ holds more than 256 files \(nothing was read\)"):
        load_recipe(str(root))
    big = _recipe(tmp_path, "big", PLAIN)
    with open(big / "custom_generate" / "blob.bin", "wb") as fh:
        fh.truncate(9_000_000)  # sparse: 9 MB listed, nothing on disk
    with pytest.raises(RecipeValidationError, match=r"holds more than 8000000 bytes \(nothing was read\)"):
        load_recipe(str(big))


def test_offline_snapshot_without_a_verified_listing_is_refused(hub_server, monkeypatch):
    from huggingface_hub import snapshot_download

    sha = _hub_recipe(hub_server, "org/nolist")
    # the files are in the Hub cache, put there by another tool, not by genkit's fetch
    snapshot_download("org/nolist", revision=sha, cache_dir=str(_cache()))
    assert (_cache() / "models--org--nolist" / "snapshots" / sha / "custom_generate" / "generate.py").is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeNotFoundError, match="was not fetched by genkit .* no verified listing"):
        load_recipe(f"org/nolist@{sha}", trust_remote_code=True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    load_recipe(f"org/nolist@{sha}", trust_remote_code=True)  # online: listed, checked, recorded
    from genkit.recipes import clear_cache

    clear_cache()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_recipe(f"org/nolist@{sha}", trust_remote_code=True).commit == sha


@pytest.mark.parametrize("lie", [{"oid": "0" * 40}, {"size": 10}])
def test_a_listing_that_does_not_match_the_served_files_is_refused(hub_server, monkeypatch, lie):
    from genkit.recipes import RecipeFetchError

    hub_server.state.commit("org/liar", {"custom_generate/generate.py": PLAIN,
                                         "README.md": "---\ntags: [custom_generate]\n---\n"})
    hub_server.state.listing_overrides["custom_generate/generate.py"] = lie
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "2")
    before = {k for k in sys.modules if k.startswith("_genkit_recipe_")}
    with pytest.raises((RecipeFetchError, RecipeValidationError),
                       match="does not match the Hub listing|Consistency|sent more than the 10 bytes its listing"):
        load_recipe("org/liar", trust_remote_code=True)
    assert {k for k in sys.modules if k.startswith("_genkit_recipe_")} == before


@pytest.mark.parametrize("value", ["false", "true", 1, 0])
def test_a_trust_flag_that_is_not_a_bool_is_refused_before_any_request(hub_server, monkeypatch, value):
    hub_server.state.commit("org/flag", {"custom_generate/generate.py": PLAIN})
    monkeypatch.setenv("GENKIT_TRUSTED_REPOS", "org/*")  # a pattern names the repo: trust would be possible
    with pytest.raises(ConfigError, match=f"`trust_remote_code` must be True, False or None; got {value!r}"):
        load_recipe("org/flag", trust_remote_code=value)
    assert not [p for _, p in hub_server.state.log if "/api/agent" not in p]


def test_load_model_refuses_a_trust_flag_that_is_not_a_bool(tmp_path, tiny_model, caplog):
    from safetensors.torch import save_file

    from genkit.models.tiny import TINY_LLAMA

    folder = _recipe(tmp_path, "model_repo", "def generate(model, **kw):\n    return 'recipe'\n")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_file({k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="`trust_remote_code` must be True, False or None; got 'true'"):
        genkit.load_model(folder, trust_remote_code="true")  # was: the recipe left unbound, silently
    assert genkit.load_model(folder, trust_remote_code=True).generate() == "recipe"
