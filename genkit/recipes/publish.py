"""``genkit publish``: check a recipe folder, then upload it with ``HfApi.create_repo`` +
``upload_folder`` (the README gets the ``custom_generate`` tag when it lacks it)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RecipeError
from .check import CheckReport, SmokeRun, check_recipe
from .errors import RecipeFetchError
from .hub import _http_errors, _short, _transport_errors, api, with_retries
from .resolve import REPO_RE, check_revision
from .settings import hub_endpoint
from .validate import with_tag

logger = logging.getLogger("genkit.recipes")

SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache", ".venv", ".mypy_cache", ".ruff_cache"}


@dataclass(frozen=True)
class Published:
    repo_id: str
    url: str
    commit: str
    revision: str
    report: CheckReport


class RecipeCheckFailed(RecipeError, ValueError):
    """``genkit check`` found errors, so nothing was uploaded."""


def _stage(root: Path, staging: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or name.endswith((".pyc", ".pyo")):
                continue
            src = Path(dirpath) / name
            if src.is_symlink():
                raise RecipeCheckFailed(f"{src} is a symlink; publish real files only")
            dst = staging / src.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    readme = staging / "README.md"
    text = readme.read_text("utf-8") if readme.is_file() else None
    tagged = with_tag(text, title=root.name)
    if tagged != text:
        logger.info("adding the custom_generate tag to README.md front matter")
        readme.write_text(tagged, encoding="utf-8")


def publish_recipe(path: str | os.PathLike[str], repo_id: str, *, revision: str | None = None, private: bool = False,
                   commit_message: str | None = None, smoke: SmokeRun | None = None) -> Published:
    """Check ``path`` (with the smoke run ``smoke``, see :func:`~genkit.recipes.check.check_recipe`) (errors raise :class:`RecipeCheckFailed`, nothing is uploaded), create the repo
    (and branch ``revision``) if needed and upload the folder; returns the commit."""
    if not REPO_RE.fullmatch(repo_id or "") or ".." in repo_id or "--" in repo_id:
        raise ConfigError(f"repo id {repo_id!r} must look like 'org/name' (letters, digits, '-', '_', '.'; no '--' "
                          "or '..', which the Hub refuses)")
    if revision is not None:
        check_revision(revision, "`revision` (the branch to publish to)")
    root = Path(os.path.abspath(os.fspath(path)))
    report = check_recipe(root, smoke=smoke)
    if not report.ok:
        raise RecipeCheckFailed("not published, `genkit check` failed:\n" + report.render())
    hf = api()
    url = with_retries("creating repo", repo_id, lambda: str(hf.create_repo(repo_id, private=private, exist_ok=True)))
    if revision and revision != "main":
        with_retries("creating branch " + revision + " in", repo_id,
                     lambda: hf.create_branch(repo_id, branch=revision, exist_ok=True))
    with tempfile.TemporaryDirectory(prefix="genkit-publish-") as tmp:
        _stage(root, Path(tmp))
        try:  # not retried: a commit that landed but whose answer was lost must not be made twice
            info = hf.upload_folder(repo_id=repo_id, folder_path=tmp, revision=revision,
                                    commit_message=commit_message or f"Publish recipe {root.name} with genkit")
        except (*_http_errors(), *_transport_errors()) as exc:
            raise RecipeFetchError(f"uploading {root} to {repo_id!r} on {hub_endpoint()} failed: {_short(exc)}") from exc
    return Published(repo_id, url, info.oid, revision or "main", report)
