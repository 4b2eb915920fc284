# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""A Hub that answers badly: the revision and the file listing are read by genkit itself, bounded
(GENKIT_HUB_TIMEOUT per read, 6x that for a whole answer, a byte limit, a page limit), and every
answer it cannot use is a RecipeFetchError naming what was asked (not a bare JSONDecodeError,
KeyError or TypeError from the Hub client, nor a hang). Every case goes through the real
huggingface_hub session against tests/hub_server.py; nothing of genkit is mocked."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hub_server import hub_server  # noqa: F401

from genkit.errors import ConfigError
from genkit.recipes import RecipeFetchError, RecipeNotFoundError, RecipeValidationError, load_recipe
from genkit.recipes.inspection import inspect_recipe

PLAIN = "def generate(model, inputs=None, **kwargs):\n    return 'plain'\n"


def _recipe(hub_server, repo: str = "org/r") -> str:
    return hub_server.state.commit(repo, {"custom_generate/generate.py": PLAIN, "README.md": "---\ntags: [x]\n---\n"})


def _cached_files() -> list[Path]:
    cache = Path(os.environ["HF_HUB_CACHE"])
    return [p for p in cache.rglob("*") if p.is_file()] if cache.exists() else []


def _quick(monkeypatch, timeout: str = "0.5", retries: str = "1") -> None:
    monkeypatch.setenv("GENKIT_HUB_TIMEOUT", timeout)
    monkeypatch.setenv("GENKIT_HUB_RETRIES", retries)


@pytest.mark.parametrize(("body", "why"), [
    (b"<html>not json</html>", "the Hub's answer is not JSON"),
    (b"[" * 100_000, "the Hub's answer is not JSON"),  # nested past Python's recursion limit
    (b'{"siblings": []}', "the Hub's answer is a JSON dict, not a list of entries"),
    (b"[1, 2]", "an entry that is not a file or folder with a path: 1"),
    (b'[{"type": "file", "size": 3}]', "an entry that is not a file or folder with a path"),
    (b'[{"type": "symlink", "path": "custom_generate/generate.py"}]', "not a file or folder with a path"),
])
def test_a_listing_genkit_cannot_read_is_a_fetch_error(hub_server, body, why):
    sha = _recipe(hub_server)
    hub_server.state.answer_next(2, match="/tree/", body=body)
    for load in (lambda: load_recipe(f"org/r@{sha}", trust_remote_code=True), lambda: inspect_recipe(f"org/r@{sha}")):
        with pytest.raises(RecipeFetchError, match=f"listing the files of org/r@{sha}: .*{why}"):
            load()
    assert not hub_server.state.file_requests() and not _cached_files()


def test_an_lfs_field_that_is_not_an_object_is_a_listing_problem(hub_server):
    sha = _recipe(hub_server)
    hub_server.state.listing_overrides["custom_generate/generate.py"] = {"lfs": 5}
    with pytest.raises(RecipeValidationError, match="custom_generate/generate.py: the listing gives no valid hash"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)
    assert not hub_server.state.file_requests()


@pytest.mark.parametrize(("body", "error", "why"), [
    (b"not json", RecipeFetchError, "resolving revision 'main' of 'org/r': the Hub's answer is not JSON"),
    (b"[1, 2]", RecipeNotFoundError, "the Hub gave no commit sha for org/r@main"),
    (b'{"sha": 5}', RecipeNotFoundError, "the Hub gave no commit sha for org/r@main .*'5'"),
])
def test_a_revision_answer_genkit_cannot_read_is_an_error_naming_it(hub_server, body, error, why):
    _recipe(hub_server)
    hub_server.state.answer_next(1, match="/revision/", body=body)
    with pytest.raises(error, match=why):
        load_recipe("org/r", trust_remote_code=True)
    assert not hub_server.state.requested("/tree/") and not _cached_files()


def test_a_listing_whose_pages_never_end_is_cut_off(hub_server, monkeypatch):
    import genkit.recipes.fetch as fetch

    monkeypatch.setattr(fetch, "MAX_LISTING_PAGES", 5)
    sha = _recipe(hub_server)
    hub_server.state.answer_next(1000, match="/tree/", body=b"[]",
                                 headers={"Link": f'<{{endpoint}}/api/models/org/r/tree/{sha}?cursor=x>; rel="next"'})
    with pytest.raises(RecipeFetchError, match="the Hub sent more than 5 pages; not read further"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)
    assert len(hub_server.state.requested("/tree/" + sha)) == 5


def test_a_next_page_on_another_host_is_not_followed(hub_server):
    sha = _recipe(hub_server)
    hub_server.state.answer_next(1, match="/tree/", body=b"[]",
                                 headers={"Link": '<http://192.0.2.1/steal-the-token>; rel="next"'})
    with pytest.raises(RecipeFetchError, match="the Hub's next page is on another host"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)


def test_a_listing_that_never_comes_times_out(hub_server, monkeypatch):
    _quick(monkeypatch)
    sha = _recipe(hub_server)
    hub_server.state.delay_next(1, 6.0, match="/tree/")
    start = time.monotonic()
    with pytest.raises(RecipeFetchError, match="listing files of 'org/r' .* failed after 1 attempts: ReadTimeout"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)
    assert time.monotonic() - start < 4


def test_a_server_asking_to_wait_does_not_set_how_long_genkit_waits(hub_server, monkeypatch, tiny_model):
    _quick(monkeypatch, timeout="5", retries="2")
    sha = _recipe(hub_server)
    hub_server.state.answer_next(1, match="/tree/", status=503, body=b"{}", headers={"Retry-After": "3600"})
    start = time.monotonic()
    assert load_recipe(f"org/r@{sha}", trust_remote_code=True)(tiny_model) == "plain"
    assert time.monotonic() - start < 10  # genkit's own backoff (0.2 s), not the server's hour


def test_a_body_sent_a_byte_at_a_time_meets_the_deadline(hub_server, monkeypatch):
    _quick(monkeypatch, timeout="0.3")  # a whole answer within 1.8 s; the body needs ~5 s
    sha = _recipe(hub_server)
    hub_server.state.drip_next(1, 0.05, match="generate.py")
    start = time.monotonic()
    with pytest.raises(RecipeFetchError, match="downloading custom_generate/generate.py of 'org/r' .*HubTimeout: "
                                               "GET .* did not finish within 1.8 s"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)
    assert time.monotonic() - start < 4
    assert not any(p.name == "generate.py" for p in _cached_files())


def test_a_redirect_loop_is_a_fetch_error(hub_server):
    sha = _recipe(hub_server)
    hub_server.state.answer_next(100, match="generate.py", status=302,
                                 headers={"Location": f"{{endpoint}}/org/r/resolve/{sha}/custom_generate/generate.py"})
    with pytest.raises(RecipeFetchError, match="downloading custom_generate/generate.py of 'org/r' .*TooManyRedirects"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)


def test_a_forbidden_answer_is_a_fetch_error(hub_server):
    sha = _recipe(hub_server)
    hub_server.state.fail_next(1, status=403, match="/tree/")
    with pytest.raises(RecipeFetchError, match="listing files of 'org/r' .*403"):
        load_recipe(f"org/r@{sha}", trust_remote_code=True)


def test_a_huge_error_body_is_not_read_whole(hub_server):
    _recipe(hub_server)
    hub_server.state.answer_next(1, match="/revision/", status=404, body=b"x" * 50_000_000,
                                 headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "no such repo"})
    with pytest.raises(RecipeNotFoundError, match="resolving revision 'main' of 'org/r'"):
        load_recipe("org/r", trust_remote_code=True)
    time.sleep(0.5)  # the server notices the closed connection
    [(_, sent)] = [s for s in hub_server.state.sent if "/revision/" in s[0]]
    assert sent < 20_000_000


@pytest.mark.parametrize(("name", "value"), [("GENKIT_HUB_TIMEOUT", "0"), ("GENKIT_HUB_TIMEOUT", "-1"),
                                             ("GENKIT_HUB_TIMEOUT", "inf"), ("GENKIT_HUB_TIMEOUT", "nan"),
                                             ("GENKIT_HUB_RETRIES", "0"), ("GENKIT_HUB_RETRIES", "-3"),
                                             ("GENKIT_RECIPE_FETCH_TIMEOUT", "0"),
                                             ("GENKIT_RECIPE_FETCH_TIMEOUT", "soon")])
def test_hub_settings_out_of_range_are_errors(hub_server, monkeypatch, name, value):
    _recipe(hub_server)
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name}='{value}' is not accepted"):
        load_recipe("org/r", trust_remote_code=True)
