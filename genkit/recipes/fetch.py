"""Step 3: fetch ``custom_generate/**`` and ``README.md`` of one commit into the ordinary Hub cache.

One file listing per commit is asked for (the tree endpoint) and checked before anything is
downloaded: odd paths, sizes that are not sizes, too many files, too many bytes. Then exactly the
listed files are read, each streamed and cut off at its listed size (a longer body is refused, a
shorter one read again), and compared with the listing's hash (git blob id; sha256 for LFS) before
it is written. The listing is kept in a manifest under ``$GENKIT_HOME/recipes/``; every later load
re-reads the cached files (bounded by their listed sizes) and re-hashes them against it, so the
bytes that are checked and imported are exactly the commit's. Nothing outside the Hub cache is
ever read, written or deleted: a symlink planted in the cache is replaced, never followed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from genkit.fileutil import atomic_write_bytes, atomic_write_text
from genkit.sandbox.tree import (
    COMPILED_PROBLEM,
    COMPILED_SUFFIXES,
    FOLDER,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_TOTAL_BYTES,
    SKIPPED_DIRS,
    check_relpath,
)

from .errors import RecipeFetchError, RecipeNotFoundError
from .hub import with_retries
from .resolve import SHA_RE, RecipeRef, check_revision, storage_folder
from .settings import genkit_home, hub_cache_dir, hub_endpoint, hub_offline

logger = logging.getLogger("genkit.recipes")

ALLOW_PATTERNS = [f"{FOLDER}/*", "README.md"]
Listing = dict[str, dict[str, Any]]


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def in_recipe(path: str) -> bool:
    """Whether a repo path is the recipe's (``README.md`` or under ``custom_generate/``)."""
    return path == "README.md" or path.startswith(f"{FOLDER}/")


def ignored(path: str) -> bool:
    """A dot-file or anything under a dot-folder or ``__pycache__/``: never downloaded, never
    importable (as :func:`genkit.sandbox.tree.scan_tree` skips them in a local folder)."""
    parts = path.split("/")[1:]
    return any(p.startswith(".") for p in parts) or any(p in SKIPPED_DIRS for p in parts[:-1])


def wanted(path: str) -> bool:
    """Whether a listed file is downloaded: the recipe's, not ignored."""
    return in_recipe(path) and not ignored(path)


def manifest_path(repo_id: str, commit: str) -> Path:
    return genkit_home() / "recipes" / "manifests" / repo_id.replace("/", "--") / f"{commit}.json"


def lock_path(repo_id: str, commit: str) -> Path:
    return genkit_home() / "locks" / f"{repo_id.replace('/', '--')}--{commit}.lock"


def _snapshot(repo_id: str, commit: str) -> Path:
    return storage_folder(repo_id) / "snapshots" / commit


def matches(data: bytes | None, meta: dict[str, Any]) -> bool:
    """Whether ``data`` is the file the listing describes: size and git blob id (sha256 for LFS files)."""
    if data is None or len(data) != meta["size"]:
        return False
    if meta.get("lfs"):
        return bool(meta.get("sha256")) and hashlib.sha256(data).hexdigest() == meta["sha256"]
    return git_blob_oid(data) == meta["oid"]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` resolves inside ``folder`` with no symlinked folder on the way."""
    real = os.path.realpath(path.parent)
    expected = os.path.join(os.path.realpath(folder), os.path.relpath(path.parent, folder))
    return real == os.path.normpath(expected)


def _cached(snapshot: Path, rel: str, meta: dict[str, Any], blobs: Path) -> bytes | None:
    """The cached bytes of a listed file when they are exactly the listed file; None otherwise
    (missing, a link out of the repo's blobs, not a regular file, another size: not even read)."""
    path = snapshot / rel
    try:
        if not _inside(path, snapshot):
            return None
        if path.is_symlink():
            target = os.path.realpath(path)
            if not target.startswith(os.path.realpath(blobs) + os.sep):
                return None
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != meta["size"]:
            return None
        with open(path, "rb") as fh:
            data = fh.read(meta["size"] + 1)
    except OSError:
        return None
    return data if matches(data, meta) else None


def unlisted(snapshot: Path, files: Listing) -> list[str]:
    """Entries under the snapshot's custom_generate/ that the commit's listing does not have."""
    base = snapshot / FOLDER
    if base.is_symlink() or (os.path.lexists(base) and not base.is_dir()):
        return [FOLDER]  # never walked through: it may point anywhere
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = Path(os.path.relpath(os.path.join(dirpath, name), snapshot)).as_posix()
            if not name.startswith(".") and rel not in files:
                out.append(rel)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return sorted(out)


def _drop_unlisted(snapshot: Path, files: Listing, repo_id: str, commit: str) -> None:
    """Online: remove entries the commit does not contain from its snapshot (with a warning); offline:
    refuse the snapshot, since nothing can say which files are the commit's. (What is imported comes
    from the listed files only; this keeps the cache honest for other tools too.)"""
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


#: pages of one file listing that are followed (the Hub sends 1000 entries a page), and their bytes in all
MAX_LISTING_PAGES = 200
MAX_LISTING_BYTES = 64_000_000


def list_files(repo_id: str, commit: str) -> Listing:
    """``{path: {"size", "oid", "lfs", "sha256"}}`` for every file of the commit (one tree listing,
    retried, at most :data:`MAX_LISTING_PAGES` pages of :data:`MAX_LISTING_BYTES` bytes in all, each
    page on the endpoint's host). Sizes and hashes are kept as the server sent them:
    :func:`check_listing` refuses bad ones; an entry that is not a file or folder is refused here."""
    what = f"listing the files of {repo_id}@{commit}"
    first = f"{hub_endpoint()}/api/models/{repo_id}/tree/{commit}?recursive=true&expand=false"
    return with_retries("listing files of", repo_id, lambda: _listing_pages(first, what))


def _listing_pages(url: str | None, what: str) -> Listing:
    from .hub import MAX_JSON_BYTES, get_json

    listing: Listing = {}
    pages = read = 0
    origin = urlsplit(hub_endpoint())[:2]
    while url is not None:
        if pages == MAX_LISTING_PAGES:
            raise RecipeFetchError(f"{what}: the Hub sent more than {MAX_LISTING_PAGES} pages; not read further")
        if urlsplit(url)[:2] != origin:
            raise RecipeFetchError(f"{what}: the Hub's next page is on another host ({url[:100]!r}); not followed")
        page, response, size = get_json(url, what, min(MAX_JSON_BYTES, MAX_LISTING_BYTES - read))
        pages, read = pages + 1, read + size
        if not isinstance(page, list):
            raise RecipeFetchError(f"{what}: the Hub's answer is a JSON {type(page).__name__}, not a list of entries")
        for entry in page:
            _add_entry(listing, entry, what)
        url = response.links.get("next", {}).get("url")
    return listing


def _add_entry(listing: Listing, entry: Any, what: str) -> None:
    """One tree entry into ``listing`` (files only; folders are implied by the files' paths)."""
    kind = entry.get("type") if isinstance(entry, dict) else None
    if kind not in ("file", "directory") or not isinstance(entry.get("path"), str):
        raise RecipeFetchError(f"{what}: the Hub's listing has an entry that is not a file or folder with a path: "
                               f"{str(entry)[:120]}")
    if kind == "file":
        lfs = entry.get("lfs")
        listing[entry["path"]] = {"size": entry.get("size"), "oid": entry.get("oid"), "lfs": lfs is not None,
                                  "sha256": lfs.get("oid") if isinstance(lfs, dict) else None}


def _parents(path: str) -> set[str]:
    parts = path.split("/")
    return {"/".join(parts[:i]) for i in range(1, len(parts))}


def _valid_size(size: Any) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and size >= 0


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _valid_hash(meta: dict[str, Any]) -> bool:
    if meta.get("lfs") is True:
        return isinstance(meta.get("sha256"), str) and bool(_SHA256_RE.fullmatch(meta["sha256"]))
    return meta.get("lfs") is False and isinstance(meta.get("oid"), str) and bool(SHA_RE.fullmatch(meta["oid"]))


def listing_problems(repo_id: str, listing: Listing) -> list[Any]:
    """Why the recipe files of a listing are refused before anything is downloaded: odd paths,
    compiled code, two names that differ only in case, sizes that are not sizes, hashes that are
    not hashes, a file over the per-file limit, too many files or bytes in all, no
    ``custom_generate/generate.py``. Dot-files and ``__pycache__/`` are left out (never downloaded)."""
    from genkit.sandbox.errors import Problem

    problems = []
    count = total = 0
    folded: dict[str, str] = {}
    for path, meta in sorted(listing.items()):
        if not in_recipe(path):
            continue
        why = check_relpath(path)
        size = meta.get("size")
        if why:
            problems.append(Problem(path, None, why))
        elif ignored(path):
            continue
        elif path.lower() in folded:
            problems.append(Problem(path, None, f"the name differs from {folded[path.lower()]} only in case: on a "
                                    "case-insensitive file system (macOS, Windows) they are one file; not downloaded"))
        elif path.endswith(COMPILED_SUFFIXES):
            problems.append(Problem(path, None, f"{COMPILED_PROBLEM} (not downloaded)"))
        elif not _valid_size(size):
            problems.append(Problem(path, None, f"the listing gives no valid size ({size!r}); not downloaded"))
        elif not _valid_hash(meta):
            problems.append(Problem(path, None, "the listing gives no valid hash (git blob id, or sha256 for an LFS "
                                    "file); not downloaded"))
        elif size > MAX_FILE_BYTES:
            problems.append(Problem(path, None, f"file is {size} bytes, over the {MAX_FILE_BYTES}-byte "
                                    "limit for recipe files (not downloaded)"))
        else:
            count, total = count + 1, total + size
        folded.setdefault(path.lower(), path)
    paths = {p.lower() for p in listing if wanted(p)}  # in any case: one file on macOS and Windows
    for path in sorted(p for p in listing if wanted(p)):
        if _parents(path.lower()) & paths:
            problems.append(Problem(path, None, "the listing has a file where this path needs a folder; not "
                                    "downloaded"))
    if count > MAX_FILES + 1:  # + README.md
        problems.append(Problem(FOLDER, None, f"the listing has {count} recipe files, over the {MAX_FILES}-file "
                                "limit (nothing downloaded)"))
    if total > MAX_TOTAL_BYTES:
        problems.append(Problem(FOLDER, None, f"the listing's recipe files hold {total} bytes, over the "
                                f"{MAX_TOTAL_BYTES}-byte limit (nothing downloaded)"))
    if f"{FOLDER}/generate.py" not in listing and not problems:
        problems.append(Problem(f"{FOLDER}/generate.py", None, f"missing: the repo {repo_id} has no "
                                f"{FOLDER}/generate.py, so it is not a recipe"))
    return problems


def check_listing(repo_id: str, listing: Listing) -> None:
    """Refuse odd paths and oversized recipe files before downloading anything."""
    from genkit.sandbox.errors import SandboxError

    problems = listing_problems(repo_id, listing)
    if problems:
        raise SandboxError(problems, where=f"Hub recipe {repo_id}")


def read_listed(repo_id: str, commit: str, path: str, meta: dict[str, Any]) -> bytes:
    """One listed file of a commit, through the Hub client's session, streamed and cut off at its
    listed size, then compared with the listing's hash. A body longer than listed is refused at
    once (:class:`RecipeValidationError`); a short or different one, or one slower than the Hub's
    deadline (:func:`genkit.recipes.hub.bounded_get`), is read again (it may be a dropped transfer)
    and ends as :class:`RecipeFetchError` naming the file."""
    from huggingface_hub import hf_hub_url

    from genkit.sandbox.errors import Problem, SandboxError

    from .hub import bounded_get

    size = meta["size"]
    url = hf_hub_url(repo_id, path, revision=commit, endpoint=hub_endpoint())

    def get() -> bytes:
        data, _ = bounded_get(url, size, lambda: SandboxError([Problem(path, None, f"the Hub sent more than the {size} "
                                                                       "bytes its listing gives; not read further")],
                                                              where=f"Hub recipe {repo_id}"))
        if not matches(data, meta):
            raise OSError(f"Consistency check failed: {path} ({len(data)} bytes read) does not match the Hub listing "
                          f"({size} bytes, {'sha256 ' + str(meta.get('sha256')) if meta.get('lfs') else 'blob ' + str(meta.get('oid'))})")
        return data

    return with_retries(f"downloading {path} of", repo_id, get)


@dataclass(frozen=True)
class Fetched:
    """The verified files of one commit: ``files`` maps repo paths (``custom_generate/...``,
    ``README.md``) to the bytes that match the commit's listing; ``snapshot`` is where they are
    cached; ``outside`` the names next to custom_generate/ in the repo."""

    snapshot: Path
    files: dict[str, bytes]
    outside: frozenset[str]

    def recipe_files(self) -> dict[str, bytes]:
        """The files under custom_generate/, relative to it."""
        prefix = f"{FOLDER}/"
        return {p[len(prefix):]: d for p, d in self.files.items() if p.startswith(prefix)}


def fetch(ref: RecipeRef, commit: str) -> Fetched:
    """The recipe files of ``commit``, verified against its listing: from the cache when every cached
    file matches the manifest kept from the first fetch, else downloaded (online only)."""
    from filelock import FileLock

    assert ref.repo_id is not None
    repo_id = ref.repo_id
    if not SHA_RE.fullmatch(commit):
        raise RecipeFetchError(f"refusing {commit!r} as the commit of {repo_id}: not a 40-hex sha")
    lock = lock_path(repo_id, commit)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        mpath = manifest_path(repo_id, commit)
        manifest = _read_manifest(mpath, repo_id)
        snapshot = _snapshot(repo_id, commit)
        blobs = storage_folder(repo_id) / "blobs"
        if manifest is not None:
            listing: Listing = manifest["files"]
            outside = frozenset(manifest["outside_names"])
            cached = {rel: _cached(snapshot, rel, meta, blobs) for rel, meta in listing.items()}
            bad = sorted(rel for rel, data in cached.items() if data is None)
            if not bad:
                _drop_unlisted(snapshot, listing, repo_id, commit)
                logger.debug("recipe %s@%s found in the cache (content re-verified)", repo_id, commit)
                _write_ref(ref, commit)
                return Fetched(snapshot, {rel: d for rel, d in cached.items() if d is not None}, outside)
            if hub_offline():
                raise RecipeNotFoundError(
                    f"the Hub cache's copy of {repo_id}@{commit} does not match the commit's listing recorded when "
                    f"it was fetched ({', '.join(bad)} missing or changed); refusing it offline (load it online "
                    "to download it again)")
            logger.warning("cached files of %s@%s do not match the commit's listing (%s); downloading them again",
                           repo_id, commit, ", ".join(bad))
        else:
            if hub_offline():
                _offline(repo_id, commit)
            full = list_files(repo_id, commit)
            check_listing(repo_id, full)
            listing = {p: m for p, m in full.items() if wanted(p)}
            outside = frozenset(p.split("/")[0].removesuffix(".py") for p in full
                                if not in_recipe(p) and not p.startswith("."))
        files: dict[str, bytes] = {}
        for rel, meta in sorted(listing.items()):
            data = _cached(snapshot, rel, meta, blobs)
            if data is None:
                data = read_listed(repo_id, commit, rel, meta)
                _store(snapshot, rel, data)
            files[rel] = data
        _drop_unlisted(snapshot, listing, repo_id, commit)
        manifest = {"repo_id": repo_id, "commit": commit, "endpoint": hub_endpoint(), "files": listing,
                    "outside_names": sorted(outside)}
        atomic_write_text(mpath, json.dumps(manifest, indent=1, sort_keys=True))
        _write_ref(ref, commit)
        return Fetched(snapshot, files, outside)


def _store(snapshot: Path, rel: str, data: bytes) -> None:
    """Write a verified file into the snapshot as a regular file, replacing whatever entry is there
    (a planted symlink is unlinked, never followed). The repo's cache folders above the snapshot
    must be real folders; a symlink at or below the snapshot is replaced by a real folder, so the
    write cannot land outside the cache."""
    root = hub_cache_dir()
    current = root
    for part in Path(os.path.relpath(snapshot / rel, root)).parts[:-1]:
        current = current / part
        if current.is_symlink() or (os.path.lexists(current) and not current.is_dir()):
            if not (current == snapshot or snapshot in current.parents):
                raise RecipeFetchError(f"the Hub cache folder {current} is a symlink or not a folder; refusing to "
                                       "write through it (delete it and load the recipe again)")
            logger.warning("replacing %s in the Hub cache: not a real folder of the snapshot", current)
            current.unlink()
    path = snapshot / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_dir():
        _discard(path)
    atomic_write_bytes(path, data)


def _discard(path: Path) -> None:
    """Remove a snapshot entry that is not the commit's: the entry itself (a symlink is unlinked,
    never what it points to; a folder only when it is empty of listed files, i.e. removed whole)."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            import shutil

            shutil.rmtree(path)  # rmtree never follows symlinks inside it
    except OSError as exc:
        logger.warning("could not remove %s from the Hub cache: %s", path, exc)


def _offline(repo_id: str, commit: str) -> None:
    """Offline with no verified listing of this commit: refuse (fail closed). Files in the Hub cache
    that genkit did not fetch and check against the commit's listing (``hf download``, a copied
    cache) cannot be told apart from files someone put there."""
    where = _snapshot(repo_id, commit)
    state = "is in the Hub cache but was not fetched by genkit" if where.is_dir() else "is not in the Hub cache"
    raise RecipeNotFoundError(
        f"offline mode (HF_HUB_OFFLINE=1) and the recipe {repo_id}@{commit} {state} {hub_cache_dir()}, so there "
        "is no verified listing of its files; load it once online (genkit records the commit's listing and "
        "checks the cached files against it on every later load)")


def _read_manifest(path: Path, repo_id: str) -> dict[str, Any] | None:
    """The manifest kept from the first fetch, or None when it is missing or not a valid listing
    of recipe files (then the commit is listed again: online only)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        return None
    files, outside = data["files"], data.get("outside_names")
    if (not all(isinstance(p, str) and wanted(p) and isinstance(m, dict) for p, m in files.items())
            or not isinstance(outside, list) or not all(isinstance(n, str) for n in outside)
            or listing_problems(repo_id, files)):
        logger.warning("ignoring the recipe manifest %s: it is not a valid listing of recipe files", path)
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


__all__ = ["ALLOW_PATTERNS", "Fetched", "RecipeFetchError", "check_listing", "fetch", "list_files", "listing_problems",
           "manifest_path", "read_listed"]
