"""Step 3: fetch ``custom_generate/**`` and ``README.md`` of one commit into the ordinary Hub cache.

Before anything is downloaded the file listing is checked (path traversal, odd names, oversized
files are refused without fetching them). After the download every file is compared with the
listing (size and git blob id) so a truncated transfer never passes for a recipe. A manifest in
``$GENKIT_HOME/recipes/`` records a verified snapshot so later loads make no request for files,
and offline mode (``HF_HUB_OFFLINE=1``) works from the cache alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from genkit.fileutil import atomic_write_text
from genkit.sandbox.tree import FOLDER, MAX_FILE_BYTES, MAX_FILES, MAX_TOTAL_BYTES, check_relpath

from .errors import RecipeFetchError, RecipeNotFoundError
from .hub import api, with_retries
from .resolve import SHA_RE, RecipeRef, check_revision, storage_folder
from .settings import genkit_home, hub_cache_dir, hub_endpoint, hub_offline, hub_timeout

logger = logging.getLogger("genkit.recipes")

ALLOW_PATTERNS = [f"{FOLDER}/*", "README.md"]


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def wanted(path: str) -> bool:
    return path == "README.md" or path.startswith(f"{FOLDER}/")


def manifest_path(repo_id: str, commit: str) -> Path:
    return genkit_home() / "recipes" / "manifests" / repo_id.replace("/", "--") / f"{commit}.json"


def lock_path(repo_id: str, commit: str) -> Path:
    return genkit_home() / "locks" / f"{repo_id.replace('/', '--')}--{commit}.lock"


def _snapshot(repo_id: str, commit: str) -> Path:
    return storage_folder(repo_id) / "snapshots" / commit


def _matches(data: bytes | None, meta: dict[str, Any]) -> bool:
    """Whether ``data`` is the file the listing describes: size and git blob id (sha256 for LFS files)."""
    if data is None or len(data) != meta["size"]:
        return False
    if meta.get("lfs"):
        return bool(meta.get("sha256")) and hashlib.sha256(data).hexdigest() == meta["sha256"]
    return git_blob_oid(data) == meta["oid"]


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def mismatched(snapshot: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """The listed files whose cached copy is missing or differs from the listing (re-hashed on every
    load: a recipe is a few KB of source)."""
    return sorted(rel for rel, meta in files.items() if not _matches(_read(snapshot / rel), meta))


def unlisted(snapshot: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Files under the snapshot's custom_generate/ that the commit's listing does not have."""
    base = snapshot / FOLDER
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = Path(os.path.relpath(os.path.join(dirpath, name), snapshot)).as_posix()
            if not name.startswith(".") and rel not in files:
                out.append(rel)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return sorted(out)


def _drop_unlisted(snapshot: Path, files: dict[str, dict[str, Any]], repo_id: str, commit: str) -> None:
    """Online: remove files the commit does not contain from its snapshot (with a warning); offline:
    refuse the snapshot, since nothing can say which files are the commit's."""
    extra = unlisted(snapshot, files)
    if not extra:
        return
    if hub_offline():
        raise RecipeNotFoundError(f"the Hub cache's copy of {repo_id}@{commit} holds files the commit does not: "
                                  f"{', '.join(extra)}; refusing it offline (delete {snapshot} or load it online)")
    logger.warning("removed %s from the cached snapshot of %s@%s: not in the commit's listing", ", ".join(extra),
                   repo_id, commit)
    for rel in extra:
        _discard(snapshot / rel)


def list_files(repo_id: str, commit: str) -> dict[str, dict[str, Any]]:
    """``{path: {"size", "oid"}}`` for every file of the commit (one tree request, retried)."""
    from huggingface_hub.hf_api import RepoFile

    entries = with_retries("listing files of", repo_id,
                           lambda: list(api().list_repo_tree(repo_id, revision=commit, recursive=True)))
    return {e.path: {"size": e.size, "oid": e.blob_id, "lfs": e.lfs is not None,
                     "sha256": e.lfs.sha256 if e.lfs is not None else None}
            for e in entries if isinstance(e, RepoFile)}


def check_listing(repo_id: str, listing: dict[str, dict[str, Any]]) -> None:
    """Refuse odd paths and oversized recipe files before downloading anything."""
    from genkit.sandbox.errors import Problem, SandboxError

    problems = []
    count = total = 0
    for path, meta in sorted(listing.items()):
        if not wanted(path):
            continue
        why = check_relpath(path)
        size = meta.get("size")
        if why:
            problems.append(Problem(path, None, why))
        elif not isinstance(size, int) or size < 0:
            problems.append(Problem(path, None, f"the listing gives no valid size ({size!r}); not downloaded"))
        elif size > MAX_FILE_BYTES:
            problems.append(Problem(path, None, f"file is {size} bytes, over the {MAX_FILE_BYTES}-byte "
                                    "limit for recipe files (not downloaded)"))
        else:
            count, total = count + 1, total + size
    if count > MAX_FILES + 1:  # + README.md
        problems.append(Problem(FOLDER, None, f"the listing has {count} recipe files, over the {MAX_FILES}-file "
                                "limit (nothing downloaded)"))
    if total > MAX_TOTAL_BYTES:
        problems.append(Problem(FOLDER, None, f"the listing's recipe files hold {total} bytes, over the "
                                f"{MAX_TOTAL_BYTES}-byte limit (nothing downloaded)"))
    if f"{FOLDER}/generate.py" not in listing and not problems:
        problems.append(Problem(f"{FOLDER}/generate.py", None, f"missing: the repo {repo_id} has no "
                                f"{FOLDER}/generate.py, so it is not a recipe"))
    if problems:
        raise SandboxError(problems, where=f"Hub recipe {repo_id}")


def fetch(ref: RecipeRef, commit: str) -> tuple[Path, frozenset[str]]:
    """Download (or find in the cache) the recipe files of ``commit``; returns (snapshot folder,
    names that sit next to custom_generate/ in the repo)."""
    from filelock import FileLock

    assert ref.repo_id is not None
    repo_id = ref.repo_id
    lock = lock_path(repo_id, commit)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        mpath = manifest_path(repo_id, commit)
        manifest = _read_manifest(mpath)
        snapshot = _snapshot(repo_id, commit)
        if manifest is not None:
            bad = mismatched(snapshot, manifest["files"])
            if not bad:
                _drop_unlisted(snapshot, manifest["files"], repo_id, commit)
                logger.debug("recipe %s@%s found in the cache (content re-verified)", repo_id, commit)
                _write_ref(ref, commit)
                return snapshot, frozenset(manifest["outside_names"])
            if hub_offline():
                raise RecipeNotFoundError(
                    f"the Hub cache's copy of {repo_id}@{commit} does not match the commit's listing recorded when "
                    f"it was fetched ({', '.join(bad)} missing or changed); refusing it offline (load it online "
                    "to download it again)")
            logger.warning("cached files of %s@%s do not match the commit's listing (%s); downloading them again",
                           repo_id, commit, ", ".join(bad))
            for rel in bad:
                _discard(snapshot / rel)
        if hub_offline():
            return _offline(repo_id, commit)
        listing = list_files(repo_id, commit)
        check_listing(repo_id, listing)
        files = {p: m for p, m in listing.items() if wanted(p)}
        outside = frozenset(p.split("/")[0].removesuffix(".py") for p in listing
                            if not wanted(p) and not p.startswith("."))
        folder = Path(with_retries("downloading recipe files of", repo_id, lambda: _download(repo_id, commit, files)))
        _drop_unlisted(folder, files, repo_id, commit)
        manifest = {"repo_id": repo_id, "commit": commit, "endpoint": hub_endpoint(), "files": files,
                    "outside_names": sorted(outside)}
        atomic_write_text(mpath, json.dumps(manifest, indent=1, sort_keys=True))
        _write_ref(ref, commit)
        return folder, outside


def _download(repo_id: str, commit: str, files: dict[str, dict[str, Any]]) -> str:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(repo_id, revision=commit, allow_patterns=ALLOW_PATTERNS,
                               cache_dir=str(hub_cache_dir()), endpoint=hub_endpoint(),
                               etag_timeout=hub_timeout())
    bad = mismatched(Path(folder), files)
    for rel in bad:
        _discard(Path(folder) / rel)
    if bad:
        raise OSError(f"Consistency check failed: downloaded {', '.join(bad)} do not match the Hub listing")
    return folder


def _discard(path: Path) -> None:
    """Remove a corrupt snapshot entry and the blob behind it so the next try downloads it again."""
    try:
        if path.is_symlink():
            blob = Path(os.path.realpath(path))
            path.unlink()
            if blob.is_file():
                blob.unlink()
        elif path.exists():
            path.unlink()
    except OSError:
        pass


def _offline(repo_id: str, commit: str) -> tuple[Path, frozenset[str]]:
    """Offline with no verified listing of this commit: refuse (fail closed). Files in the Hub cache
    that genkit did not fetch and check against the commit's listing (``hf download``, a copied
    cache) cannot be told apart from files someone put there."""
    where = _snapshot(repo_id, commit)
    state = "is in the Hub cache but was not fetched by genkit" if where.is_dir() else "is not in the Hub cache"
    raise RecipeNotFoundError(
        f"offline mode (HF_HUB_OFFLINE=1) and the recipe {repo_id}@{commit} {state} {hub_cache_dir()}, so there "
        "is no verified listing of its files; load it once online (genkit records the commit's listing and "
        "checks the cached files against it on every later load)")


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None
    return data


def _write_ref(ref: RecipeRef, commit: str) -> None:
    """Record branch/tag -> commit in the cache's refs/ (what offline mode reads)."""
    if SHA_RE.fullmatch(ref.revision):
        return
    check_revision(ref.revision)
    if not SHA_RE.fullmatch(commit):
        raise RecipeFetchError(f"refusing to record {commit!r} as the commit of {ref.repo_id}@{ref.revision}: "
                               "not a 40-hex sha")
    refs = storage_folder(ref.repo_id or "") / "refs"
    path = refs / ref.revision
    if not os.path.realpath(path).startswith(os.path.realpath(refs) + os.sep):
        raise RecipeFetchError(f"revision {ref.revision!r} would write outside the Hub cache's refs/ folder")
    try:
        if path.is_file() and path.read_text() == commit:
            return
        atomic_write_text(path, commit)
    except OSError as exc:  # a read-only cache still works online
        logger.debug("could not record %s -> %s: %s", path, commit, exc)


__all__ = ["ALLOW_PATTERNS", "RecipeFetchError", "check_listing", "fetch", "list_files", "manifest_path"]
