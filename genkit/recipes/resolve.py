"""Step 1: turn a recipe reference into a local folder or a Hub repo + commit sha."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import RecipeNotFoundError
from .hub import api, with_retries
from .settings import hub_cache_dir, hub_offline, hub_timeout

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


def parse_ref(ref: str | os.PathLike[str], revision: str | None = None) -> RecipeRef:
    """A local folder holding ``custom_generate/``, or ``org/repo`` / ``org/repo@revision``."""
    if not isinstance(ref, (str, os.PathLike)):
        raise ValueError(f"a recipe reference must be a folder path or 'org/repo[@revision]'; got {type(ref).__name__}")  # noqa: TRY004
    text = os.fspath(ref)
    if os.path.isdir(text):
        if revision is not None:
            raise ValueError(f"`revision` applies to Hub recipes only; {text!r} is a local folder")
        return RecipeRef(text, "local", path=Path(os.path.abspath(text)))
    base, at, rev = text.partition("@")
    if REPO_RE.fullmatch(base) and ".." not in base and not text.startswith((".", "/", "~")):
        if at and not rev:
            raise ValueError(f"recipe reference {text!r} has an empty revision after '@'")
        if at and revision is not None and revision != rev:
            raise ValueError(f"recipe reference {text!r} names revision {rev!r} but `revision`={revision!r} was "
                             "also given; pass one")
        return RecipeRef(text, "hub", repo_id=base, revision=rev or revision or "main")
    if os.sep in text or text.startswith((".", "~")) or (os.altsep and os.altsep in text):
        raise RecipeNotFoundError(f"no recipe folder at {text!r} (it does not exist or is not a folder)")
    raise ValueError(f"recipe reference {text!r} is neither an existing folder nor a Hub id "
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
        ref_file = storage_folder(ref.repo_id) / "refs" / ref.revision
        if ref_file.is_file():
            return ref_file.read_text().strip()
        raise RecipeNotFoundError(
            f"offline mode (HF_HUB_OFFLINE=1) and revision {ref.revision!r} of {ref.repo_id!r} is not in the Hub "
            f"cache {hub_cache_dir()}; load it once online or pin a cached commit 'org/repo@<sha>'"
        )
    info = with_retries("resolving revision " + repr(ref.revision) + " of", ref.repo_id,
                        lambda: api().model_info(ref.repo_id, revision=ref.revision, timeout=hub_timeout()))
    sha = getattr(info, "sha", None)
    if not sha or not SHA_RE.fullmatch(sha):
        raise RecipeNotFoundError(f"the Hub gave no commit sha for {ref.repo_id}@{ref.revision}")
    return sha
