"""The one recipe pipeline: resolve → trust gate → fetch → validate → requirements → import.

Every way into a recipe uses these steps, in this order, each only after the one before passed:

* :func:`genkit.recipes.load_recipe` (``generate(custom_generate=...)``, a model repo's attached
  recipe): all six, strict (the first failing step raises);
* ``genkit check`` (:func:`genkit.recipes.check.check_recipe`): resolve, read, validate and
  requirements collecting problems instead of raising, then the trust gate before its smoke run,
  which is a full :func:`load_recipe`;
* ``genkit inspect`` (:func:`genkit.recipes.inspection.inspect_recipe`): resolve, read into memory
  (nothing written), validate and requirements collecting problems; never the import.

So a file a loader would refuse is a problem ``inspect`` and ``check`` show, with the same words.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genkit.sandbox import Finding, Problem, SandboxError, SourceTree, audit_tree, check_source, scan_tree
from genkit.sandbox.tree import FOLDER, tree_from_files

from .errors import RequirementsFormatError
from .hub import recipe_deadline
from .requirements import Status, check_requirements, ensure_requirements
from .resolve import RecipeRef, parse_ref

logger = logging.getLogger("genkit.recipes")

#: the most of a README that is read (``genkit inspect``, ``genkit check``): it is only displayed
MAX_README_BYTES = 256_000


@dataclass
class Source:
    """What the fetch step produced: the recipe's files in memory, checked by the same rules for a
    local folder and a Hub commit. ``problems`` is filled only when reading did not raise
    (``strict=False``); the files with problems are then left out of ``tree``."""

    ref: RecipeRef
    commit: str | None
    label: str
    tree: SourceTree
    readme: str | None = None
    listing: list[tuple[str, int]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # e.g. "README.md: not read (over the limit)"


# -- 1. resolve ------------------------------------------------------------------------------------
def resolve(ref: str | os.PathLike[str], revision: str | None = None, *, trust_remote_code: bool | None = None,
            needs_trust: bool = False) -> tuple[RecipeRef, str | None]:
    """A parsed reference and, for a Hub repo, its commit sha (pinned, or a branch/tag resolved at
    most once per :func:`genkit.recipes.resolve_interval`; offline from the cache's ``refs/``).
    ``needs_trust``: a Hub reference that no flag or trusted-repos entry could trust is refused
    before any request is made."""
    from . import _commit_of
    from .resolve import resolve_commit
    from .trust import check_trust, could_be_trusted

    parsed = parse_ref(ref, revision)
    if parsed.kind == "local":
        return parsed, None
    if needs_trust and not could_be_trusted(parsed, trust_remote_code):
        check_trust(parsed, parsed.revision if parsed.pinned else None, trust_remote_code)
    with recipe_deadline():
        return parsed, _commit_of(parsed, resolve_commit)


# -- 2. trust gate ---------------------------------------------------------------------------------
def gate(parsed: RecipeRef, commit: str | None, trust_remote_code: bool | None) -> str:
    """Why the recipe may run, or :class:`RecipeTrustError`. Nothing is fetched or written before it."""
    from .trust import check_trust

    return check_trust(parsed, commit, trust_remote_code)


# -- 3. fetch (read) ---------------------------------------------------------------------------
def read(parsed: RecipeRef, commit: str | None, *, store: bool = True, strict: bool = True,
         readme_limit: int | None = None) -> Source:
    """The recipe's files in memory. A local folder is scanned (limits from ``stat`` first); a Hub
    commit is fetched into the Hub cache and re-verified against its listing (``store=True``), or
    read into memory only (``store=False``: ``genkit inspect``), in both cases only the listed files,
    each bounded by its listed size and checked against its listed hash. ``strict``: raise
    :class:`RecipeValidationError`; otherwise record the problems and keep the acceptable files."""
    if parsed.kind == "local":
        return _read_local(parsed, strict, readme_limit)
    assert parsed.repo_id is not None and commit is not None
    with recipe_deadline():  # the load's deadline when there is one (GENKIT_RECIPE_FETCH_TIMEOUT)
        return _read_hub(parsed, commit, store, strict, readme_limit)


def _read_local(parsed: RecipeRef, strict: bool, readme_limit: int | None) -> Source:
    assert parsed.path is not None
    label = f"local recipe {parsed.path}"
    readme = None
    path = parsed.path / "README.md"
    if path.is_file():
        with open(path, "rb") as fh:  # bounded: a local README can be any size too
            readme = fh.read(readme_limit or MAX_README_BYTES).decode("utf-8", "replace")
    try:
        tree = scan_tree(parsed.path)
    except SandboxError as exc:
        if strict:
            raise
        empty = SourceTree(parsed.path, {}, "", frozenset())
        return Source(parsed, None, label, empty, readme, problems=list(exc.problems))
    listing = [(f"{FOLDER}/{p}", len(d)) for p, d in sorted(tree.files.items())]
    return Source(parsed, None, label, tree, readme, listing)


def _read_hub(parsed: RecipeRef, commit: str, store: bool, strict: bool, readme_limit: int | None) -> Source:
    from .fetch import fetch, in_recipe, list_files, listing_problems, read_listed, wanted

    repo_id = parsed.repo_id or ""
    label = f"Hub recipe {repo_id}@{commit}"
    notes: list[str] = []
    problems: list[Problem] = []
    if store:
        fetched = fetch(parsed, commit)  # lists once, checks the listing, verifies every file (raises)
        root, files, outside = fetched.snapshot, fetched.files, fetched.outside
        listing = [(p, len(d)) for p, d in sorted(files.items())]
    else:
        full = list_files(repo_id, commit)
        listing = [(p, m["size"]) for p, m in sorted(full.items())]
        problems = listing_problems(repo_id, full)
        if problems and strict:
            raise SandboxError(problems, where=f"Hub recipe {repo_id}")
        refused = {p.path for p in problems}
        over_limits = FOLDER in refused  # too many files or bytes in all: nothing is read
        files = {}
        for path, meta in sorted(full.items()):
            if not wanted(path) or path in refused or over_limits:
                continue
            if path == "README.md" and readme_limit is not None and meta["size"] > readme_limit:
                notes.append(f"README.md: {meta['size']} bytes, over the {readme_limit}-byte limit (not read)")
                continue
            files[path] = read_listed(repo_id, commit, path, meta)
        root = Path(f"<{repo_id}@{commit}>")
        outside = frozenset(p.split("/")[0].removesuffix(".py") for p in full
                            if not in_recipe(p) and not p.startswith("."))
    readme_bytes = files.get("README.md")
    readme = None if readme_bytes is None else readme_bytes[:readme_limit or MAX_README_BYTES].decode("utf-8", "replace")
    prefix = f"{FOLDER}/"
    recipe_files = {p[len(prefix):]: d for p, d in files.items() if p.startswith(prefix)}
    tree, more = tree_from_files(root, recipe_files, outside, where=label, strict=strict)
    return Source(parsed, commit, label, tree, readme, listing, problems + more, notes)


# -- 4. validate -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Validated:
    parsed: dict[str, Any]
    problems: list[Problem]
    findings: list[Finding]


def validate(source: Source, *, strict: bool = True) -> Validated:
    """Parse (never run) every file: the ``generate(model, ...)`` signature, the import rules and the
    audit. ``strict``: every problem in one :class:`RecipeValidationError`."""
    from .validate import signature_problems

    parsed, problems = check_source(source.tree)
    signature = signature_problems(parsed, source.tree.files)
    if any(p.path == f"{FOLDER}/generate.py" for p in source.problems):
        signature = []  # generate.py was refused while reading; that problem is reported already
    problems = signature + problems
    if problems and strict:
        raise SandboxError(problems, where=source.label)
    return Validated(parsed, problems, audit_tree(source.tree, parsed))


# -- 5. requirements -------------------------------------------------------------------------------
def requirements(source: Source, *, enforce: bool = True) -> tuple[list[Status], list[str]]:
    """The status of each line of ``custom_generate/requirements.txt`` and format errors.
    ``enforce``: raise one :class:`RequirementsError` (an ImportError) listing every unmet line."""
    data = source.tree.files.get("requirements.txt")
    if data is None:
        return [], []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        error = RequirementsFormatError(f"{source.label}: custom_generate/requirements.txt is not UTF-8 text")
        if enforce:
            raise error from exc
        return [], [str(error)]
    name = source.ref.repo_id or str(source.ref.path)
    try:
        if enforce:
            return ensure_requirements(text, source.label, name=name), []
        return check_requirements(text, label=source.label), []
    except RequirementsFormatError as exc:
        if enforce:
            raise
        return [], [str(exc)]


# -- 6. import -------------------------------------------------------------------------------------
def import_generate(source: Source) -> Any:
    """Import the checked bytes under the recipe's private package name; its ``generate``."""
    from genkit.sandbox import import_tree

    from .errors import RecipeImportError

    module = import_tree(source.tree, "generate", source.label)
    generate = getattr(module, "generate", None)
    if not callable(generate):
        raise RecipeImportError(f"{source.label}: custom_generate/generate.py did not leave a callable `generate` "
                                "after it was imported")
    return module, generate


__all__ = ["MAX_README_BYTES", "Source", "Validated", "gate", "import_generate", "read", "requirements", "resolve",
           "validate"]
