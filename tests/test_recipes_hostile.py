# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""More hostile cases for the recipe loader (issue #11), mostly from a misbehaving Hub server and a
hostile Hub cache: listings that change between requests, bodies longer than listed, listings with
no usable size, any revision answered, planted symlinks in the cache, deeply nested front matter,
and recipes that rebind the import system. Every Hub case goes through the real huggingface_hub
client against tests/hub_server.py; nothing of genkit is mocked."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hub_server import hub_server, write_recipe  # noqa: F401

import genkit
from genkit.cli import main as cli
from genkit.recipes import (
    RecipeFetchError,
    RecipeNotFoundError,
    RecipeValidationError,
    clear_cache,
    load_recipe,
)
from genkit.recipes.check import check_recipe
from genkit.recipes.inspection import inspect_recipe

PLAIN = "def generate(model, inputs=None, **kwargs):\n    return 'plain'\n"
README = "---\ntags: [custom_generate]\n---\n"


def _cache() -> Path:
    return Path(os.environ["HF_HUB_CACHE"])


def _hub_recipe(hub_server, repo: str, **files: str | bytes) -> str:
    content: dict[str, str | bytes] = {"custom_generate/generate.py": PLAIN, "README.md": README}
    content.update({f"custom_generate/{k}": v for k, v in files.items()})
    return hub_server.state.commit(repo, content)


def _file_gets(hub_server, name: str) -> list[str]:
    return [p for m, p in hub_server.state.file_requests() if m == "GET" and p.endswith("/" + name)]


# -- a server whose later listings differ from the one that was checked ----------------------------
def test_files_added_after_the_checked_listing_are_never_downloaded(hub_server, tiny_model):
    sha = _hub_recipe(hub_server, "org/late")
    hub_server.state.late_files = {"custom_generate/evil.py": b"import os\nos.environ['PWNED'] = '1'\n",
                                   "custom_generate/huge.bin": b"x" * 5_000_000}
    recipe = load_recipe(f"org/late@{sha}", trust_remote_code=True)
    assert recipe(tiny_model) == "plain"
    assert hub_server.state.tree_requests == 1  # the checked listing is the only one
    assert not _file_gets(hub_server, "evil.py") and not _file_gets(hub_server, "huge.bin")
    assert not any(_cache().rglob("evil.py")) and not any(_cache().rglob("huge.bin"))


def test_inspect_reads_only_what_its_one_listing_names(hub_server):
    _hub_recipe(hub_server, "org/late2")
    hub_server.state.late_files = {"custom_generate/evil.py": b"X = 1\n"}
    result = inspect_recipe("org/late2")
    assert [p for p, _ in result.files] == [".gitattributes", "README.md", "custom_generate/generate.py"]
    assert hub_server.state.tree_requests == 1 and not _file_gets(hub_server, "evil.py")


# -- bodies longer than listed: reading stops at the listed size, for load as for inspect ----------
def _sent_after_hang_up(hub_server, suffix, wait=10.0):
    """The bytes the server got out before the client hung up (its thread records them when its
    next write fails, which can come after the client has already raised)."""
    deadline = time.monotonic() + wait
    while True:
        sent = [n for p, n in hub_server.state.sent if p.endswith(suffix)]
        if sent or time.monotonic() > deadline:
            return sent
        time.sleep(0.02)


def test_load_stops_reading_a_body_longer_than_listed(hub_server):
    sha = _hub_recipe(hub_server, "org/long")
    hub_server.state.oversize_next(5, extra=60_000_000, match=r"generate\.py")
    with pytest.raises(RecipeValidationError, match=r"the Hub sent more than the \d+ bytes its listing gives"):
        load_recipe(f"org/long@{sha}", trust_remote_code=True)
    sent = _sent_after_hang_up(hub_server, "generate.py")
    assert sent and max(sent) < 30_000_000  # the client hung up; it did not take the 60 MB
    snapshot = _cache() / "models--org--long" / "snapshots" / sha
    assert not snapshot.exists() or not any(p.is_file() for p in snapshot.rglob("*.py"))
    assert sum(p.stat().st_size for p in _cache().rglob("*") if p.is_file()) < 1_000_000


def test_a_truncated_body_is_read_again_and_then_runs(hub_server, tiny_model):
    sha = _hub_recipe(hub_server, "org/short")
    hub_server.state.truncate_next(1, match=r"generate\.py")
    assert load_recipe(f"org/short@{sha}", trust_remote_code=True)(tiny_model) == "plain"
    assert len(_file_gets(hub_server, "generate.py")) == 2


# -- listings with no usable size or over the limits: a clear problem, nothing read --------------
@pytest.mark.parametrize("size", [None, "12", -1, 1.5, True])
def test_a_listing_without_a_usable_size_is_refused(hub_server, size):
    _hub_recipe(hub_server, "org/nosize")
    hub_server.state.listing_overrides["custom_generate/generate.py"] = {"size": size}
    hub_server.state.log.clear()
    with pytest.raises(RecipeValidationError, match="the listing gives no valid size"):
        load_recipe("org/nosize", trust_remote_code=True)
    result = inspect_recipe("org/nosize")
    assert any("the listing gives no valid size" in p for p in result.problems)
    assert not _file_gets(hub_server, "generate.py")


@pytest.mark.parametrize(("files", "why"), [
    ({f"m{i}.py": "X = 1\n" for i in range(300)}, r"the listing has 30\d recipe files, over the 256-file limit"),
    ({f"big{i}.py": "#" * 999_000 for i in range(9)}, r"hold \d+ bytes, over the 8000000-byte limit"),
])
def test_inspect_checks_the_limits_from_the_listing_before_reading(hub_server, capsys, files, why):
    _hub_recipe(hub_server, "org/wide", **files)
    hub_server.state.log.clear()
    assert cli(["inspect", "org/wide"]) == 0
    out = capsys.readouterr().out
    assert "problems:" in out and __import__("re").search(why, out)
    assert not [p for m, p in hub_server.state.file_requests() if p.endswith(".py")]


def test_inspect_reports_a_hub_file_the_loader_would_refuse(hub_server):
    # the same checks as the loader: a non-UTF-8 declaration, a name that is no module, compiled code
    _hub_recipe(hub_server, "org/odd", **{"helper.py": b"# coding: latin-1\nX = 1\n", "my-mod.py": "X = 1\n",
                                          "fast.so": b"\x7fELF"})
    problems = "\n".join(inspect_recipe("org/odd").problems)
    assert "encoding declaration 'latin-1'" in problems
    assert "'my-mod.py' is not an importable module name" in problems
    assert "compiled or native code is not allowed" in problems
    with pytest.raises(RecipeValidationError, match=r"fast.so: compiled or native code .*\(not downloaded\)"):
        load_recipe("org/odd", trust_remote_code=True)  # refused from the listing, before any download
    hub_server.state.commit("org/odd", {}, deleted=("custom_generate/fast.so",))
    clear_cache()  # "main" moved
    with pytest.raises(RecipeValidationError) as err:
        load_recipe("org/odd", trust_remote_code=True)
    for line in ("encoding declaration 'latin-1'", "not an importable module name"):
        assert line in str(err.value)


# -- a server that answers any revision --------------------------------------------------------
@pytest.mark.parametrize("rev", ["../../../../tmp/x", "..", "a/../b", "x\ny", "v" * 70 + "é" * 100])
def test_a_server_answering_any_revision_changes_nothing(hub_server, rev):
    _hub_recipe(hub_server, "org/any")
    hub_server.state.any_revision = True
    with pytest.raises(ValueError, match="is not a valid git revision"):
        load_recipe("org/any", revision=rev, trust_remote_code=True)
    with pytest.raises(ValueError, match="is not a valid git revision"):
        inspect_recipe("org/any", revision=rev)
    assert not [p for _, p in hub_server.state.log if "/api/agent" not in p]
    assert not _cache().exists() or not [p for p in _cache().rglob("*") if p.is_file()]


def test_a_revision_answer_that_is_not_a_sha_is_refused(hub_server, monkeypatch):
    _hub_recipe(hub_server, "org/badsha")
    monkeypatch.setattr(type(hub_server.state), "any_revision", True, raising=False)
    repo = hub_server.state.repo("org/badsha")
    repo.branches["dev"] = "../../../../etc"  # the server resolves `dev` to a path, not a sha
    with pytest.raises(RecipeNotFoundError):
        load_recipe("org/badsha@dev", trust_remote_code=True)
    assert not (_cache() / "models--org--badsha" / "refs" / "dev").exists()


# -- a hostile Hub cache: planted symlinks never make genkit read or delete outside it -----------
def test_a_planted_symlink_never_deletes_the_file_it_points_to(hub_server, tmp_path, tiny_model):
    sha = _hub_recipe(hub_server, "org/victim")
    load_recipe(f"org/victim@{sha}", trust_remote_code=True)
    clear_cache()
    victim, other = tmp_path / "victim.txt", tmp_path / "other.txt"
    victim.write_text("the user's file\n")
    other.write_text("another file of the user\n")
    folder = _cache() / "models--org--victim" / "snapshots" / sha / "custom_generate"
    (folder / "generate.py").unlink()
    os.symlink(victim, folder / "generate.py")  # a listed file replaced by a link to a user file
    os.symlink(other, folder / "planted.py")  # an unlisted file that is a link to a user file
    assert load_recipe(f"org/victim@{sha}", trust_remote_code=True)(tiny_model) == "plain"
    assert victim.read_text() == "the user's file\n" and other.read_text() == "another file of the user\n"
    assert not (folder / "planted.py").exists() and not (folder / "planted.py").is_symlink()


def test_a_planted_link_to_a_huge_file_is_not_read_into_memory(hub_server, tmp_path, tiny_model):
    sha = _hub_recipe(hub_server, "org/huge")
    load_recipe(f"org/huge@{sha}", trust_remote_code=True)
    clear_cache()
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as fh:
        fh.truncate(300_000_000)  # sparse: nothing on disk, 300 MB if read
    target = _cache() / "models--org--huge" / "snapshots" / sha / "custom_generate" / "generate.py"
    target.unlink()
    os.symlink(huge, target)
    tracemalloc.start()
    try:
        assert load_recipe(f"org/huge@{sha}", trust_remote_code=True)(tiny_model) == "plain"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50_000_000 and huge.stat().st_size == 300_000_000


def test_a_tampered_manifest_path_never_leaves_the_cache(hub_server, tmp_path):
    from genkit.recipes.fetch import manifest_path

    sha = _hub_recipe(hub_server, "org/mani")
    load_recipe(f"org/mani@{sha}", trust_remote_code=True)
    clear_cache()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    mpath = manifest_path("org/mani", sha)
    data = json.loads(mpath.read_text())
    rel = os.path.relpath(victim, _cache() / "models--org--mani" / "snapshots" / sha)
    data["files"][rel] = {"size": 1, "oid": "0" * 40, "lfs": False, "sha256": None}
    mpath.write_text(json.dumps(data))
    load_recipe(f"org/mani@{sha}", trust_remote_code=True)  # the bad manifest is dropped, the commit listed again
    assert victim.read_text() == "keep me\n"
    assert rel not in json.loads(mpath.read_text())["files"]


# -- class 1: the declaration is found on the lines Python reads as lines 1 and 2 ----------------
@pytest.mark.parametrize("head", [b"#a\x0c#b\n", b"# one\xc2\x85two\n", b"#\xe2\x80\xa8x\n", b"#\x1c\n"])
def test_declaration_on_python_line_two_is_found_whatever_splitlines_says(tmp_path, head):
    root = write_recipe(tmp_path / "r", {"custom_generate/generate.py":
                                         head + b"# coding: latin-1\n" + PLAIN.encode()})
    with pytest.raises(RecipeValidationError, match="encoding declaration 'latin-1'"):
        load_recipe(str(root))


# -- class 2: a revision too long for a file name, counted in bytes --------------------------------
def test_a_revision_over_255_bytes_is_refused_before_any_request(hub_server):
    rev = "é" * 200  # 200 characters, 400 bytes: no file system takes it as a ref file name
    with pytest.raises(ValueError, match="is not a valid git revision"):
        load_recipe("org/r", revision=rev, trust_remote_code=True)
    assert not [p for _, p in hub_server.state.log if "/api/agent" not in p]


# -- class 6: front matter nested without aliases cannot crash or exhaust genkit inspect ----------
@pytest.mark.parametrize("meta", ["tags: " + "[" * 20_000 + "]" * 20_000, "tags:\n" + "- " * 20_000 + "x",
                                  "tags: " + "{a: " * 5000 + "1" + "}" * 5000])
def test_deeply_nested_front_matter_is_refused_not_a_crash(hub_server, tmp_path, capsys, meta):
    readme = f"---\n{meta}\n---\n# deep\n"
    assert len(readme) < 64_000
    hub_server.state.commit("org/deep", {"custom_generate/generate.py": PLAIN, "README.md": readme})
    assert cli(["inspect", "org/deep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["front_matter"] is None and any("front matter" in p for p in out["problems"])
    local = write_recipe(tmp_path / "deep", {"custom_generate/generate.py": PLAIN}, readme=readme)
    assert cli(["inspect", str(local)]) == 0
    report = check_recipe(local, smoke=False)
    assert any("front matter" in w for w in report.warnings)


# -- class 7: a recipe that rebinds the import system's lists ------------------------------------
@pytest.mark.parametrize("change", [
    "import sys\nsys.path = ['/tmp/evil-site']\n",
    "import sys\nsys.path = tuple(sys.path)\n",
    "import sys\nsys.meta_path = list(sys.meta_path)\nsys.meta_path.insert(0, object())\n",
    "import sys\nsys.path_hooks.insert(0, lambda p: None)\nsys.path_importer_cache.clear()\n",
])
def test_rebinding_the_import_system_is_undone(tmp_path, tiny_model, caplog, change):
    path, meta, hooks = sys.path, sys.meta_path, list(sys.path_hooks)
    path_copy, meta_copy = list(path), list(meta)
    root = write_recipe(tmp_path / "rebind", {"custom_generate/generate.py": change + PLAIN})
    with caplog.at_level(logging.WARNING, logger="genkit.sandbox"):
        assert genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate=str(root)) == "plain"
    assert sys.path is path and sys.path == path_copy
    assert sys.meta_path is meta and [f for f in sys.meta_path if f in meta_copy] == meta_copy
    assert sys.path_hooks == hooks
    assert any("the change was undone" in r.getMessage() for r in caplog.records)


# -- retries: a hash mismatch that persists ends as a fetch error naming the file ------------------
def test_a_persistent_hash_mismatch_is_a_fetch_error(hub_server, monkeypatch):
    _hub_recipe(hub_server, "org/lie")
    hub_server.state.listing_overrides["custom_generate/generate.py"] = {"oid": "1" * 40}
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "2")
    with pytest.raises(RecipeFetchError, match=r"custom_generate/generate.py .*does not match the Hub listing"):
        load_recipe("org/lie", trust_remote_code=True)
    assert len(_file_gets(hub_server, "generate.py")) == 2


# -- front matter of odd shapes: inspect and check report it, never crash --------------------------
@pytest.mark.parametrize("meta", ["tags: 5", "tags: {a: 1}", "2024-01-01: x\ntags: [custom_generate]",
                                  "tags: [custom_generate]\nblob: !!binary aGVsbG8=", "tags: [1, custom_generate]"])
def test_front_matter_of_any_shape_is_reported_not_a_crash(hub_server, tmp_path, capsys, meta):
    readme = f"---\n{meta}\n---\n# odd\n"
    hub_server.state.commit("org/shape", {"custom_generate/generate.py": PLAIN, "README.md": readme})
    assert cli(["inspect", "org/shape", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tagged = "custom_generate" in meta and "tags: {" not in meta
    assert any("`tags` must be a list" in p for p in out["problems"]) == (meta in ("tags: 5", "tags: {a: 1}"))
    assert (not any("README.md" in p for p in out["problems"])) == tagged
    local = write_recipe(tmp_path / "shape", {"custom_generate/generate.py": PLAIN}, readme=readme)
    assert check_recipe(local, smoke=False).ok


# -- a listing with a file where another listed path needs a folder --------------------------------
def test_a_listing_with_a_file_where_a_folder_is_needed_is_refused(hub_server):
    _hub_recipe(hub_server, "org/clash", **{"pkg/mod.py": "X = 1\n"})
    # the server also lists `custom_generate/pkg` as a file (git cannot; a lying server can)
    repo = hub_server.state.repo("org/clash")
    head = repo.branches["main"]
    repo.commits[head].files["custom_generate/pkg"] = b"X = 2\n"
    hub_server.state.log.clear()
    with pytest.raises(RecipeValidationError, match="a file where this path needs a folder"):
        load_recipe("org/clash", trust_remote_code=True)
    assert not hub_server.state.file_requests()


# -- what a listing names is checked before anything is written: nothing compiled, nothing ignored ---
@pytest.mark.parametrize("name", ["native.so", "pkg/helper.pyc", "lib.pyd"])
def test_compiled_files_in_a_listing_are_refused_before_download(hub_server, name):
    sha = _hub_recipe(hub_server, "org/native", **{name: b"\x7fELF not python"})
    with pytest.raises(RecipeValidationError, match=f"custom_generate/{name}: compiled or native code is not "
                                                    r"allowed in a recipe; ship Python source \(not downloaded\)"):
        load_recipe(f"org/native@{sha}", trust_remote_code=True)
    assert not hub_server.state.file_requests()
    assert not _cache().exists() or not [p for p in _cache().rglob("*") if p.is_file()]
    assert f"custom_generate/{name}: compiled or native code" in "\n".join(inspect_recipe(f"org/native@{sha}").problems)


@pytest.mark.parametrize("name", ["__pycache__/generate.cpython-311.pyc", ".hidden.py", ".git/hooks/post-checkout",
                                  "pkg/__pycache__/x.cpython-311.pyc"])
def test_ignored_files_of_a_listing_are_never_downloaded(hub_server, tiny_model, name):
    sha = _hub_recipe(hub_server, "org/ignored", **{name: b"import os\nos.environ['PWNED'] = '1'\n",
                                                    "pkg/__init__.py": ""})
    recipe = load_recipe(f"org/ignored@{sha}", trust_remote_code=True)
    assert recipe(tiny_model) == "plain"
    assert not _file_gets(hub_server, name.rsplit("/", 1)[-1])
    on_disk = sorted(p.relative_to(recipe.path).as_posix() for p in recipe.path.rglob("*") if p.is_file())
    assert on_disk == ["README.md", "custom_generate/generate.py", "custom_generate/pkg/__init__.py"]


@pytest.mark.parametrize("other", ["Generate.py", "GENERATE.PY"])
def test_names_that_differ_only_in_case_are_refused(hub_server, other):
    sha = _hub_recipe(hub_server, "org/case", **{other: "def generate(model, **kw):\n    return 'other'\n"})
    with pytest.raises(RecipeValidationError, match=f"custom_generate/generate.py: the name differs from "
                                                    f"custom_generate/{other} only in case"):
        load_recipe(f"org/case@{sha}", trust_remote_code=True)
    assert not hub_server.state.file_requests()


def test_a_file_and_a_folder_that_differ_only_in_case_are_refused(hub_server):
    sha = _hub_recipe(hub_server, "org/casedir", **{"Utils": "x", "utils/__init__.py": ""})
    with pytest.raises(RecipeValidationError, match="custom_generate/utils/__init__.py: the listing has a file where "
                                                    "this path needs a folder"):
        load_recipe(f"org/casedir@{sha}", trust_remote_code=True)
    assert not hub_server.state.file_requests()


# -- a server that trickles: the HTTP library's timeouts are per read, genkit's limits are wall-clock ----
def _leftovers(hub_server, sha: str) -> list[str]:
    """What a failed fetch left: any file in the Hub cache that is not a whole file of the commit
    (a part of one, a temporary file) and genkit's manifest of the commit (written only when all is fetched)."""
    from genkit.recipes.fetch import manifest_path

    committed = hub_server.state.repo("org/r").commits[sha].files
    snapshot = _cache() / "models--org--r" / "snapshots" / sha
    out = [str(p) for p in _cache().rglob("*") if p.is_file() and not (
        p.parent.is_relative_to(snapshot) and committed.get(p.relative_to(snapshot).as_posix()) == p.read_bytes())]
    return out + ([str(manifest_path("org/r", sha))] if manifest_path("org/r", sha).exists() else [])


@pytest.mark.parametrize("what", ["/revision/", "/tree/", "generate.py"])
def test_answer_headers_sent_a_byte_at_a_time_meet_the_per_request_limit(hub_server, monkeypatch, what):
    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", "0.25")  # a whole answer within 1.5 s; the trickle needs ~25 s
    monkeypatch.setenv("GENKIT_HUB_RETRIES", "1")
    sha = _hub_recipe(hub_server, "org/r")
    hub_server.state.drip_headers_next(1, 0.1, match=what)
    asked = {"/revision/": "resolving revision 'main' of 'org/r'", "/tree/": "listing files of 'org/r'",
             "generate.py": "downloading custom_generate/generate.py of 'org/r'"}[what]
    path = {"/revision/": "/api/models/org/r/revision/main", "/tree/": f"/api/models/org/r/tree/{sha}",
            "generate.py": f"/org/r/resolve/{sha}/custom_generate/generate.py"}[what]
    start = time.monotonic()
    with pytest.raises(RecipeFetchError, match=f"{asked} from .* failed after 1 attempts: HubTimeout: GET {path} "
                                               r"did not finish within 1.5 s \(6 x GENKIT_HUB_TIMEOUT\)"):
        load_recipe("org/r", trust_remote_code=True)
    assert time.monotonic() - start < 4
    assert not _leftovers(hub_server, sha)


def test_a_body_that_keeps_coming_stops_at_the_recipe_load_limit_without_a_retry(hub_server, monkeypatch):
    monkeypatch.setenv("GENKIT_RECIPE_FETCH_TIMEOUT", "1.5")  # each answer alone would get 6 x 10 s
    sha = _hub_recipe(hub_server, "org/r")
    hub_server.state.drip_next(5, 0.1, match="generate.py")
    start = time.monotonic()
    with pytest.raises(RecipeFetchError, match=f"downloading custom_generate/generate.py of 'org/r' from .*: HubTimeout: "
                                               f"GET /org/r/resolve/{sha}/custom_generate/generate.py stopped: the "
                                               r"recipe's Hub requests did not finish within 1.5 s "
                                               r"\(GENKIT_RECIPE_FETCH_TIMEOUT\)"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)
    assert time.monotonic() - start < 3.5
    assert len(_file_gets(hub_server, "generate.py")) == 1  # past the load's limit nothing is tried again
    assert not _leftovers(hub_server, sha)


def test_slow_answers_add_up_to_the_recipe_load_limit(hub_server, monkeypatch):
    """Each answer is within its own limit, but a load of many slow ones is stopped, inspect's too."""
    monkeypatch.setenv("GENKIT_RECIPE_FETCH_TIMEOUT", "2")
    sha = _hub_recipe(hub_server, "org/r", **{f"m{i}.py": f"X = {i}\n" for i in range(8)})
    hub_server.state.delay_next(100, 0.5, match="/resolve/")
    for load in (lambda: load_recipe(f"org/r@{sha}", trust_remote_code=True), lambda: inspect_recipe(f"org/r@{sha}")):
        start = time.monotonic()
        with pytest.raises(RecipeFetchError, match=r"stopped: the recipe's Hub requests did not finish within 2 s"):
            load()
        assert time.monotonic() - start < 3.5
    assert not _leftovers(hub_server, sha)
