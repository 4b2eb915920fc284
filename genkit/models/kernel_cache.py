"""A cache of compiled C libraries that are checked before they are loaded.

A library in the cache is loaded only when all of these hold, else it is rebuilt:

* the cache folder belongs to the current user and is not writable by group or others (a folder
  that fails this is not used at all: the library is built in a private temporary folder, loaded
  from there and not kept, with a warning that names the folder and the reason);
* the library is a regular file (not a symlink: it is opened with ``O_NOFOLLOW``), belongs to the
  current user and is not writable by group or others;
* its sha256 equals the one recorded beside it (``<name>.sha256``) when it was built.

A build compiles in a private temporary folder (``mkdtemp``) inside the cache folder and moves the
result onto its name with ``os.replace``, under a file lock (``.build.lock``), so two processes
building at once end with one good library. Files and folders are created with mode 0755 (minus
the user's umask): never writable by group or others. The library is loaded through the file
descriptor that was checked (``/proc/self/fd/N`` where there is one), so a file swapped in after
the check is not the one loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import KernelUnavailableError
from ..fileutil import current_umask

logger = logging.getLogger("genkit.models")

MODE = 0o755  # what cache files and folders are created with (the umask applies); never g/o-writable
DIGEST_SUFFIX = ".sha256"
LOCK_NAME = ".build.lock"
BuildFn = Callable[[Path], None]
"""``build(out)``: compile the library to the path ``out`` (raise on failure)."""


def _unsafe(st: os.stat_result, what: str) -> str:
    """Why a file or folder with status ``st`` cannot be trusted ('' when it can)."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} belongs to user id {st.st_uid}, not to the current user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _recorded_digest(target: Path) -> str:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(target.with_name(target.name + DIGEST_SUFFIX), flags)
    except OSError:
        return ""
    try:
        return os.read(fd, 128).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _open_checked(target: Path) -> tuple[int | None, str]:
    """An open descriptor on ``target`` when it passes the checks, else ``(None, why)``."""
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None, "not built yet"
    except OSError as exc:  # ELOOP: a symlink
        return None, f"cannot be opened as a plain file ({exc.strerror}; a symlink is refused)"
    st = os.fstat(fd)
    why = "" if stat.S_ISREG(st.st_mode) else "is not a regular file"
    why = why or _unsafe(st, "it")
    if not why:
        recorded = _recorded_digest(target)
        why = "" if recorded and recorded == _sha256_fd(fd) else "its sha256 does not match the one recorded at build"
    if why:
        os.close(fd)
        return None, why
    return fd, ""


_LOADED_FDS: list[int] = []  # the descriptors libraries were loaded through, kept open (see _dlopen)


def _dlopen(fd: int, target: Path) -> Any:
    """Load the checked file open on ``fd``. The descriptor stays open once loaded: the dynamic
    loader knows a library by the name it was opened under, so a second library loaded through a
    reused ``/proc/self/fd/N`` would be taken for the first (the block and the dense kernel in one
    process)."""
    proc = f"/proc/self/fd/{fd}"
    try:
        lib = ctypes.CDLL(proc if os.path.exists(proc) else str(target))
    except BaseException:
        os.close(fd)
        raise
    _LOADED_FDS.append(fd)
    return lib


def _load_cached(target: Path) -> Any:
    fd, why = _open_checked(target)
    if fd is None:
        if why != "not built yet":
            logger.warning("the cached library %s is not loaded: %s; rebuilding it", target, why)
        return None
    return _dlopen(fd, target)


def _safe_folder(folder: Path) -> str:
    """Create ``folder`` (mode 0755 minus the umask) if needed; why it cannot be trusted ('' if it can)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, MODE)
    except FileExistsError:
        pass
    return _unsafe(os.stat(folder), f"the folder {folder}")


def _build_into(folder: Path, name: str, build: BuildFn) -> Path:
    """Build in a private temporary folder under ``folder``; record the sha256 and move the
    library onto ``folder / name`` atomically."""
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".build-"))
    try:
        out = tmp / name
        build(out)
        os.chmod(out, MODE & ~current_umask())
        fd = os.open(out, os.O_RDONLY)
        try:
            digest = _sha256_fd(fd)
        finally:
            os.close(fd)
        digest_tmp = tmp / (name + DIGEST_SUFFIX)
        with open(os.open(digest_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w", encoding="ascii") as fh:
            fh.write(digest + "\n")
        os.replace(digest_tmp, folder / (name + DIGEST_SUFFIX))
        os.replace(out, folder / name)  # atomic: another process sees the whole library or none
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built %s", folder / name)
    return folder / name


def load(folder: Path, name: str, build: BuildFn) -> Any:
    """The library ``folder / name`` loaded with ctypes, built with ``build`` first when it is
    missing or fails the checks (see the module docstring). Raises ``RuntimeError``/``OSError``
    when it cannot be built or the fresh build fails its checks."""
    why = _safe_folder(folder)
    if why:
        logger.warning("not using the kernel cache: %s; building the library in a private folder for this "
                       "process (fix the folder's owner or mode to cache it)", why)
        with tempfile.TemporaryDirectory(prefix="genkit-kernel-") as tmp:  # mode 0700
            out = Path(tmp) / name
            build(out)
            return ctypes.CDLL(str(out))  # stays mapped after the folder is removed
    lib = _load_cached(folder / name)
    if lib is not None:
        return lib
    with FileLock(str(folder / LOCK_NAME), mode=0o644):
        fd, _ = _open_checked(folder / name)  # another process may have built it meanwhile
        if fd is None:
            _build_into(folder, name, build)
            fd, why = _open_checked(folder / name)
            if fd is None:
                raise KernelUnavailableError(f"the freshly built library {folder / name} fails its checks: {why}")
        return _dlopen(fd, folder / name)


def store(folder: Path, name: str, write: BuildFn) -> bool:
    """Write a data file ``folder / name`` with ``write(out)`` the way libraries are built (a private
    temporary file, its sha256 recorded beside it, moved onto its name atomically, under the
    folder's lock). False (nothing written, a warning logged) when the folder cannot be trusted."""
    why = _safe_folder(folder)
    if why:
        logger.warning("not writing %s: %s", folder / name, why)
        return False
    with FileLock(str(folder / LOCK_NAME), mode=0o644):
        _build_into(folder, name, write)
    return True


def read_checked(folder: Path, name: str) -> bytes | None:
    """The contents of ``folder / name`` when it and its folder pass the checks of this module
    (owner, mode, no symlink, the sha256 recorded when :func:`store` wrote it); None otherwise,
    with a warning naming the reason unless the file does not exist."""
    if not folder.is_dir():
        return None
    why = _unsafe(os.stat(folder), f"the folder {folder}")
    fd, why = (None, why) if why else _open_checked(folder / name)
    if fd is None:
        if why != "not built yet":
            logger.warning("the cached file %s is not used: %s", folder / name, why)
        return None
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
