"""Collect a recipe's ``custom_generate/`` files into memory, rejecting odd names, links that leave
the folder, compiled or binary code and oversized files, and hash the result.

Everything that is later compiled and run comes from the bytes read here, so what was checked is
exactly what runs (no window for the files to change in between).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Problem, SandboxError

FOLDER = "custom_generate"
MAX_FILE_BYTES = 1_000_000
MAX_TOTAL_BYTES = 8_000_000
MAX_FILES = 256
MAX_DEPTH = 8
COMPILED_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib", ".pyx", ".pxd")
SKIPPED_DIRS = ("__pycache__",)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SourceTree:
    """The files of ``root/custom_generate`` (posix paths relative to that folder -> bytes)."""

    root: Path
    files: dict[str, bytes]
    content_hash: str
    outside_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def folder(self) -> Path:
        return self.root / FOLDER

    def modules(self) -> dict[str, str]:
        """Dotted module name (relative to the recipe package) -> file; packages map to __init__.py."""
        out: dict[str, str] = {}
        for rel in self.files:
            if not rel.endswith(".py"):
                continue
            parts = rel[:-3].split("/")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = rel
        return out

    def packages(self) -> set[str]:
        """Dotted names of every sub-folder (importable as a package, with or without __init__.py)."""
        out: set[str] = set()
        for rel in self.files:
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add(".".join(parts[:i]))
        return out

    def top_level_names(self) -> set[str]:
        """Names a module or package at the top of custom_generate/ would be imported by."""
        names = {m.split(".")[0] for m in self.modules() if m}
        names |= {p.split(".")[0] for p in self.packages()}
        return names

    def display(self, rel: str) -> str:
        return f"{FOLDER}/{rel}"

    def source(self, rel: str) -> str:
        """The text of a ``.py`` file, decoded once from the bytes read: UTF-8, a leading BOM dropped.

        Everything that parses, audits or compiles recipe code uses this text (never the bytes, whose
        ``# coding:`` line Python would obey when compiling), so what is checked is what runs."""
        return decode_source(self.files[rel])


def decode_source(data: bytes) -> str:
    """UTF-8 text of a recipe source file without its BOM (scan_tree has checked that it decodes)."""
    return data.decode("utf-8").removeprefix("\ufeff")


# PEP 263: an encoding declaration is a comment matching this on line 1 or 2
_CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")
_PYTHON_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_UTF8_NAMES = {"utf-8", "utf8", "utf_8", "u8", "utf", "cp65001", "utf-8-sig", "utf_8_sig"}


def encoding_declaration_problem(text: str) -> str | None:
    """Why the text's ``# coding:`` declaration is refused (``None`` when absent or UTF-8)."""
    for line in _PYTHON_LINE_BREAK.split(text, maxsplit=2)[:2]:  # Python's lines, not str.splitlines()'s
        match = _CODING.match(line)
        if match:
            name = match.group(1).lower()
            if name in _UTF8_NAMES or name.replace("-", "_") in _UTF8_NAMES:
                return None
            return (f"encoding declaration {match.group(1)!r}: recipe files must be UTF-8 (genkit checks and runs "
                    "the UTF-8 text, so another declared encoding would make them differ)")
        if line.strip() and not line.lstrip().startswith("#"):
            return None  # the declaration must come before any code
    return None


def content_hash(files: dict[str, bytes]) -> str:
    """sha256 over the sorted (path, sha256(content)) pairs."""
    h = hashlib.sha256(b"genkit-recipe-v1\n")
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest() + b"\n")
    return h.hexdigest()


MAX_NAME_LENGTH = 100  # characters of one path component (file systems stop at 255 bytes)
MAX_PATH_LENGTH = 512


def check_name(name: str) -> str | None:
    """Why a single path component is refused, or None when it is fine."""
    if len(name) > MAX_NAME_LENGTH:
        return f"file name {name[:40]!r}... is {len(name)} characters long, over the {MAX_NAME_LENGTH}-character limit"
    if not name.isascii():
        return f"file name {name!r} is not ASCII"
    if ".." in name or not _NAME.fullmatch(name.removeprefix(".")):
        return f"file name {name!r} is not allowed (letters, digits, '_', '-', '.', no '..')"
    return None


def check_relpath(rel: str) -> str | None:
    """Why a repo-relative posix path is refused (traversal, odd components), or None."""
    if rel.startswith("/") or "\\" in rel:
        return f"path {rel!r} is not a relative posix path"
    if len(rel) > MAX_PATH_LENGTH:
        return f"path {rel[:60]!r}... is {len(rel)} characters long, over the {MAX_PATH_LENGTH}-character limit"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"path {rel!r} leaves or escapes its folder"
        why = check_name(part)
        if why:
            return why
    return None


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_size_before_reading(folder: Path, root: Path, max_total_bytes: int) -> None:
    """File count and total bytes of ``folder`` from ``stat`` alone, refused before any file is read
    (a folder of a million files, or of many-GB files, costs no memory)."""
    count = total = 0
    stack = [(str(folder), 0)]
    while stack:
        directory, depth = stack.pop()
        if depth > MAX_DEPTH:
            continue  # the walk reports it
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue  # the walk reports it
        for entry in entries:
            if entry.name.startswith(".") or entry.name in SKIPPED_DIRS:
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append((entry.path, depth + 1))
                continue
            count += 1
            try:
                total += entry.stat(follow_symlinks=True).st_size
            except OSError:
                pass
            if count > MAX_FILES or total > max_total_bytes:
                what = (f"more than {MAX_FILES} files" if count > MAX_FILES
                        else f"more than {max_total_bytes} bytes")
                raise SandboxError([Problem(FOLDER, None, f"custom_generate/ holds {what} (nothing was read)")],
                                   where=f"recipe at {root}")


class _TreeWalk:
    """:func:`scan_tree`'s walk of custom_generate/: the files read so far and every problem found."""

    def __init__(self, allowed: list[str], max_file_bytes: int, max_total_bytes: int) -> None:
        self.allowed, self.max_file_bytes, self.max_total_bytes = allowed, max_file_bytes, max_total_bytes
        self.problems: list[Problem] = []
        self.files: dict[str, bytes] = {}
        self.total = 0

    def walk(self, directory: Path, rel_dir: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.problems.append(Problem(f"{FOLDER}/{rel_dir}", None, f"folders nested deeper than {MAX_DEPTH}"))
            return
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            self.problems.append(Problem(f"{FOLDER}/{rel_dir}", None, f"cannot be listed ({exc.strerror})"))
            return
        for entry in entries:
            rel = f"{rel_dir}{entry.name}"
            shown = f"{FOLDER}/{rel}"
            if entry.is_dir(follow_symlinks=False) and entry.name in SKIPPED_DIRS:
                continue
            why = check_name(entry.name)
            if why:
                self.problems.append(Problem(shown, None, why))
                continue
            if entry.name.startswith("."):
                continue  # dot-files (.gitkeep, .DS_Store) are neither read nor importable
            if entry.is_symlink():
                why = self._link_problem(entry)
                if why:
                    self.problems.append(Problem(shown, None, why))
                    continue
            try:
                st = os.stat(entry.path)
            except OSError as exc:  # a dangling symlink or a loop of links
                self.problems.append(Problem(shown, None, f"cannot be read ({exc.strerror}): a dangling symlink or "
                                             "a loop of symlinks?"))
                continue
            if stat.S_ISDIR(st.st_mode):
                self.walk(Path(entry.path), rel + "/", depth + 1)
                continue
            self._read(entry, rel, shown, st)

    def _link_problem(self, entry: os.DirEntry[str]) -> str | None:
        """Why the symlink ``entry`` may not be followed (it leaves the allowed folders, or names a folder)."""
        target = os.path.realpath(entry.path)
        if not any(_within(target, a) for a in self.allowed):
            return f"symlink leaves custom_generate/ (points to {target})"
        if os.path.isdir(target):
            return "symlinks to folders are not allowed"
        return None

    def _read(self, entry: os.DirEntry[str], rel: str, shown: str, st: os.stat_result) -> None:
        """Read the file ``entry`` into :attr:`files`, or record why it cannot be."""
        max_file_bytes, max_total_bytes = self.max_file_bytes, self.max_total_bytes
        if not stat.S_ISREG(st.st_mode):
            self.problems.append(Problem(shown, None, "not a regular file"))
            return
        if entry.name.endswith(COMPILED_SUFFIXES):
            self.problems.append(Problem(shown, None, COMPILED_PROBLEM))
            return
        if st.st_size > max_file_bytes:
            self.problems.append(Problem(shown, None, f"file is {st.st_size} bytes, over the {max_file_bytes}-byte "
                                         "limit for recipe files"))
            return
        if len(self.files) >= MAX_FILES:
            self.problems.append(Problem(shown, None, f"more than {MAX_FILES} files in custom_generate/"))
            return
        with open(entry.path, "rb") as fh:  # bounded: the file may have grown since its stat
            data = fh.read(max_file_bytes + 1)
        self.total += len(data)
        if len(data) > max_file_bytes or self.total > max_total_bytes:
            self.problems.append(Problem(shown, None, f"custom_generate/ holds more than {max_total_bytes} bytes"
                                         if self.total > max_total_bytes else f"file is over the {max_file_bytes}-byte "
                                         "limit for recipe files"))
            return
        why = content_problem(rel, data)
        if why:
            self.problems.append(Problem(shown, why[0], why[1]))
            return
        self.files[rel] = data


def scan_tree(root: str | os.PathLike[str], *, link_roots: tuple[str | os.PathLike[str], ...] = (),
              outside_names: frozenset[str] | None = None, max_file_bytes: int = MAX_FILE_BYTES,
              max_total_bytes: int = MAX_TOTAL_BYTES) -> SourceTree:
    """Read ``root/custom_generate/**`` into memory after checking every entry.

    ``link_roots``: extra folders that symlinks may point into (the Hub cache's ``blobs/``).
    ``outside_names``: names of the files and folders next to custom_generate/ (computed from
    ``root`` when None) for the sibling-import check. Raises :class:`SandboxError` listing every
    problem found.
    """
    root = Path(os.path.abspath(os.fspath(root)))
    folder = root / FOLDER
    if folder.is_symlink() or not folder.is_dir():
        raise SandboxError([Problem(FOLDER, None, "missing: a recipe needs a custom_generate/ folder "
                                    "with generate.py")], where=f"recipe at {root}")
    allowed = [os.path.realpath(folder)] + [os.path.realpath(p) for p in link_roots]
    _check_size_before_reading(folder, root, max_total_bytes)
    walk = _TreeWalk(allowed, max_file_bytes, max_total_bytes)
    walk.walk(folder, "", 0)
    if walk.problems:
        raise SandboxError(walk.problems, where=f"recipe at {root}")
    files = walk.files
    if outside_names is None:
        outside_names = frozenset(
            (n.removesuffix(".py")) for n in os.listdir(root) if n != FOLDER
        )
    return SourceTree(root, files, content_hash(files), frozenset(outside_names))


COMPILED_PROBLEM = "compiled or native code is not allowed in a recipe; ship Python source"


def content_problem(rel: str, data: bytes) -> tuple[int | None, str] | None:
    """(line, why) when the file ``rel`` (relative to custom_generate/) with content ``data`` is
    refused: a ``.py`` file must have an importable name and be UTF-8 text without NUL bytes or a
    non-UTF-8 encoding declaration. The same rule for a folder on disk and for files in memory."""
    name = rel.rsplit("/", 1)[-1]
    if not name.endswith(".py"):
        return None
    if not _MODULE.fullmatch(name[:-3]):
        return None, f"{name!r} is not an importable module name"
    if b"\x00" in data:
        return None, "binary content (NUL bytes) in a Python file"
    try:
        text = decode_source(data)
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 text (byte {exc.start})"
    refused = encoding_declaration_problem(text)
    if refused:
        return 1, refused
    return bidi_problem(text)


# Unicode bidirectional controls: they reorder how code is displayed, so what a reviewer reads is
# not what runs ("Trojan Source", CVE-2021-42574)
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")
_BIDI = re.compile("[" + "".join(sorted(BIDI_CONTROLS)) + "]")


def bidi_problem(text: str) -> tuple[int, str] | None:
    """(line, why) at the first bidirectional control character of ``text``, or None."""
    match = _BIDI.search(text)
    if match is None:
        return None
    line = text.count("\n", 0, match.start()) + 1
    return line, (f"bidirectional control character U+{ord(match.group()):04X}: it makes the code display "
                  "differently from how it runs (Trojan Source); remove it, or write it as an escape in a string")


def tree_from_files(root: str | os.PathLike[str], files: dict[str, bytes], outside_names: frozenset[str], *,
                    where: str, strict: bool = True) -> tuple[SourceTree, list[Problem]]:
    """A :class:`SourceTree` from files already in memory (``custom_generate/``-relative posix path ->
    bytes, e.g. a Hub commit's files), under the same rules as :func:`scan_tree`: names, compiled
    code, limits, UTF-8 and encoding declarations. Dot-files and ``__pycache__/`` are left out, as on
    disk. ``strict``: raise :class:`SandboxError` listing every problem; otherwise return the tree
    of the acceptable files and the problems."""
    problems: list[Problem] = []
    kept: dict[str, bytes] = {}
    total = 0
    for rel, data in sorted(files.items()):
        shown = f"{FOLDER}/{rel}"
        why = check_relpath(rel)
        if why:
            problems.append(Problem(shown, None, why))
            continue
        parts = rel.split("/")
        if any(p.startswith(".") for p in parts) or any(p in SKIPPED_DIRS for p in parts[:-1]):
            continue
        if len(parts) > MAX_DEPTH + 1:
            problems.append(Problem(shown, None, f"folders nested deeper than {MAX_DEPTH}"))
            continue
        if rel.endswith(COMPILED_SUFFIXES):
            problems.append(Problem(shown, None, COMPILED_PROBLEM))
            continue
        total += len(data)
        if len(data) > MAX_FILE_BYTES or total > MAX_TOTAL_BYTES or len(kept) >= MAX_FILES:
            problems.append(Problem(shown, None, f"over the limits for recipe files ({MAX_FILES} files, "
                                    f"{MAX_FILE_BYTES} bytes each, {MAX_TOTAL_BYTES} in all)"))
            continue
        content = content_problem(rel, data)
        if content:
            problems.append(Problem(shown, content[0], content[1]))
            continue
        kept[rel] = data
    if problems and strict:
        raise SandboxError(problems, where=where)
    return SourceTree(Path(os.fspath(root)), kept, content_hash(kept), frozenset(outside_names)), problems
