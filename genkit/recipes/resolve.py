"""Step 1: turn a recipe reference into a local folder or a Hub repo + commit sha."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..errors import ConfigError
from .errors import RecipeNotFoundError
from .hub import get_json, with_retries
from .settings import hub_cache_dir, hub_endpoint, hub_offline

logger = logging.getLogger("genkit.recipes")

SHA_RE = re.compile(r"[0-9a-f]{40}")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_RE = re.compile(rf"{_PART}/{_PART}")


@dataclass(frozen=True)
class RecipeRef:
    """A parsed reference: ``local`` (``path`` set) or ``hub`` (``repo_id`` + ``revision``)."""

    ref: str
    kind: str
    path: Path | None = None
    repo_id: str | None = None
    revision: str = "main"

    @property
    def pinned(self) -> bool:
        return bool(SHA_RE.fullmatch(self.revision))


MAX_REVISION_LENGTH = 255
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f-\x9f~^:?*\[\\]")


def _utf8_length(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a file name's limit is in bytes); lone surrogates count as too long."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return MAX_REVISION_LENGTH + 1


def check_revision(revision: str, what: str = "revision") -> str:
    """``revision`` if it is a 40-hex commit sha or a valid git ref name (``git check-ref-format``
    rules: no ``..``, ``//``, ``@{``, control characters, spaces or ``~^:?*[\\``; no component
    starting with ``.`` or ending in ``.lock``; not ``@``; no leading/trailing ``/`` or trailing ``.``);
    otherwise a ``ValueError`` naming it. Checked before any path is built from a revision."""
    if not isinstance(revision, str) or not revision:
        raise ConfigError(f"{what} must be a non-empty branch, tag or 40-hex commit sha; got {revision!r}")
    if SHA_RE.fullmatch(revision):
        return revision
    bad = (
        _utf8_length(revision) > MAX_REVISION_LENGTH or _REF_FORBIDDEN.search(revision) or ".." in revision
        or "//" in revision or "@{" in revision or revision == "@" or revision.startswith("/")
        or revision.endswith(("/", ".")) or any(p.startswith(".") or p.endswith(".lock") for p in revision.split("/"))
    )
    if bad:
        raise ConfigError(f"{what} {revision!r} is not a valid git revision: use a branch or tag name (git ref "
                          f"rules: no '..', spaces, control characters or any of ~^:?*[\\; at most "
                          f"{MAX_REVISION_LENGTH} bytes in UTF-8) or a 40-hex commit sha")
    return revision


def parse_ref(ref: str | os.PathLike[str], revision: str | None = None) -> RecipeRef:
    """A local folder holding ``custom_generate/``, or ``org/repo`` / ``org/repo@revision``."""
    if not isinstance(ref, (str, os.PathLike)):
        raise ConfigError(f"a recipe reference must be a folder path or 'org/repo[@revision]'; got {type(ref).__name__}")  # noqa: TRY004
    text = os.fspath(ref)
    if os.path.isdir(text):
        if revision is not None:
            raise ConfigError(f"`revision` applies to Hub recipes only; {text!r} is a local folder")
        if REPO_RE.fullmatch(text) and not text.startswith((".", "/", "~")):
            # transformers' precedence: an existing local folder wins over the Hub repo of that name
            logger.warning("recipe %r is both a local folder (%s) and a Hub id; using the local folder. Pass "
                           "'%s@main' for the Hub repo, or './%s' to name the folder without this warning",
                           text, os.path.abspath(text), text, text)
        return RecipeRef(text, "local", path=Path(os.path.abspath(text)))
    base, at, rev = text.partition("@")
    if REPO_RE.fullmatch(base) and "--" in base:
        raise ConfigError(f"recipe reference {text!r}: '--' is not allowed in a Hub id (the Hub refuses it, and "
                         "genkit's cache folder 'org--name' would be shared with another id)")
    if REPO_RE.fullmatch(base) and ".." not in base and not text.startswith((".", "/", "~")):
        if at and not rev:
            raise ConfigError(f"recipe reference {text!r} has an empty revision after '@'")
        if at and revision is not None and revision != rev:
            raise ConfigError(f"recipe reference {text!r} names revision {rev!r} but `revision`={revision!r} was "
                              "also given; pass one")
        chosen = check_revision(rev or revision or "main", f"the revision of {base!r}")
        return RecipeRef(text, "hub", repo_id=base, revision=chosen)
    if os.sep in text or text.startswith((".", "~")) or (os.altsep and os.altsep in text):
        raise RecipeNotFoundError(f"no recipe folder at {text!r} (it does not exist or is not a folder)")
    raise ConfigError(f"recipe reference {text!r} is neither an existing folder nor a Hub id "
                      "'org/repo' / 'org/repo@revision' (branch, tag or 40-hex commit sha)")


def storage_folder(repo_id: str) -> Path:
    """The repo's folder in the Hub cache (``models--org--name``)."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def resolve_commit(ref: RecipeRef) -> str:
    """The commit sha a Hub reference points at (a request to the revision endpoint unless the
    revision is already a sha; from the cache's ``refs/`` in offline mode)."""
    assert ref.repo_id is not None
    if ref.pinned:
        return ref.revision
    if hub_offline():
        check_revision(ref.revision)
        refs = storage_folder(ref.repo_id) / "refs"
        ref_file = refs / ref.revision
        if not os.path.realpath(ref_file).startswith(os.path.realpath(refs) + os.sep):
            raise RecipeNotFoundError(f"revision {ref.revision!r} of {ref.repo_id!r} leaves the Hub cache's refs/ "
                                      "folder (a symlink?); refusing it")
        if ref_file.is_file():
            sha = ref_file.read_text(encoding="ascii", errors="replace").strip()
            if not SHA_RE.fullmatch(sha):
                raise RecipeNotFoundError(f"the Hub cache's ref file {ref_file} does not hold a 40-hex commit sha; "
                                          "refusing it (delete it and load the recipe once online)")
            return sha
        raise RecipeNotFoundError(
            f"offline mode (HF_HUB_OFFLINE=1) and revision {ref.revision!r} of {ref.repo_id!r} is not in the Hub "
            f"cache {hub_cache_dir()}; load it once online or pin a cached commit 'org/repo@<sha>'"
        )
    what = f"resolving revision {ref.revision!r} of"
    url = f"{hub_endpoint()}/api/models/{ref.repo_id}/revision/{quote(ref.revision, safe='')}"
    info, _, _ = with_retries(what, ref.repo_id, lambda: get_json(url, f"{what} {ref.repo_id!r}"))
    sha = info.get("sha") if isinstance(info, dict) else None
    if not isinstance(sha, str) or not SHA_RE.fullmatch(sha):
        raise RecipeNotFoundError(f"the Hub gave no commit sha for {ref.repo_id}@{ref.revision} (its answer's "
                                  f"'sha' field is {str(sha)[:60]!r})")
    return sha
