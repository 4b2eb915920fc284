"""Step 5: check ``custom_generate/requirements.txt`` against the installed distributions (PEP 508).

At most :data:`MAX_REQUIREMENTS` requirement lines. Accepted lines: ``name``, ``name>=1,<2``, ``name[extra]>=1``, ``name>=1; python_version >= "3.10"``,
comments (``#``, whole-line or trailing) and blank lines. Refused with the line number: malformed
requirements, URL requirements (``name @ https://…``, ``git+https://…``) and pip options
(``-r``, ``-e``, ``--index-url`` …) — a recipe cannot make genkit install or fetch anything.
All unmet lines are reported together in one ``ImportError``: ``name>=x (installed: y)``.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .errors import RequirementsError, RequirementsFormatError


@dataclass(frozen=True)
class Line:
    number: int
    text: str
    requirement: Requirement


@dataclass(frozen=True)
class Status:
    """One requirement line and what is installed: ``ok`` False means unmet."""

    line: Line
    installed: str | None
    ok: bool
    skipped: bool = False  # marker does not apply here
    detail: str = ""

    def __str__(self) -> str:
        req = self.line.requirement
        shown = f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}"
        return f"{shown} (installed: {self.installed}{self.detail})"


#: requirement lines (not comments or blank lines) a recipe may have: each costs a look-up of the
#: installed distributions, and ``genkit inspect`` checks them for recipes nobody trusts yet
MAX_REQUIREMENTS = 256


def parse_requirements(text: str, source: str = "custom_generate/requirements.txt", label: str = "recipe") -> list[Line]:
    """Parse the file; raise :class:`RequirementsFormatError` naming the first bad line(s), or the
    line past :data:`MAX_REQUIREMENTS` requirements (before any of them is looked up)."""
    lines: list[Line] = []
    errors: list[str] = []
    text = text.removeprefix("\ufeff")  # a UTF-8 BOM (Windows editors write one)
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(lines) + len(errors) == MAX_REQUIREMENTS:
            raise RequirementsFormatError(f"{label}: cannot accept its requirements: {source}:{number}: more than "
                                          f"{MAX_REQUIREMENTS} requirement lines; a recipe lists what it imports")
        body = stripped.split(" #", 1)[0].split("\t#", 1)[0].strip()
        where = f"{source}:{number}: {stripped!r}"
        if body.startswith("-"):
            errors.append(f"{where}: pip options (-r, -e, -c, --index-url, ...) are not allowed in a recipe's "
                          "requirements; list package names with version specifiers only")
            continue
        if "://" in body or body.startswith(("git+", "hg+", "svn+", "bzr+", "file:")):
            errors.append(f"{where}: URL requirements are not allowed; name a released package with a "
                          "version specifier (e.g. 'numpy>=1.24')")
            continue
        try:
            req = Requirement(body)
        except InvalidRequirement as exc:
            errors.append(f"{where}: not a valid PEP 508 requirement ({exc})")
            continue
        if req.url:
            errors.append(f"{where}: URL requirements are not allowed")
            continue
        lines.append(Line(number, stripped, req))
    if errors:
        raise RequirementsFormatError(f"{label}: cannot accept its requirements:\n  " + "\n  ".join(errors))
    return lines


@functools.lru_cache(maxsize=4096)
def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _satisfies(req: Requirement, version: str) -> bool:
    try:
        Version(version)
    except InvalidVersion:
        return False
    return req.specifier.contains(version, prereleases=True)


@functools.lru_cache(maxsize=512)
def _extra_requirements(name: str) -> tuple[Requirement, ...]:
    """The installed distribution ``name``'s requirements that only an extra pulls in."""
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return ()
    out = []
    for spec in requires:
        try:
            dep = Requirement(spec)
        except InvalidRequirement:
            continue
        if dep.marker is not None and not dep.marker.evaluate({**default_environment(), "extra": ""}):
            out.append(dep)
    return tuple(out)


def _extras_unmet(req: Requirement) -> list[str]:
    """Requirements that ``req``'s extras pull in and that are not satisfied."""
    unmet = []
    environment = default_environment()
    for extra in sorted(req.extras):
        for dep in _extra_requirements(req.name):
            if dep.marker is None or not dep.marker.evaluate({**environment, "extra": extra}):
                continue
            have = _installed(dep.name)
            if have is None or not _satisfies(dep, have):
                unmet.append(f"{dep.name}{dep.specifier} for extra [{extra}] (installed: {have})")
    return unmet


def check_requirements(text: str, source: str = "custom_generate/requirements.txt",
                       label: str = "recipe") -> list[Status]:
    """The status of every line (lines whose marker does not apply are ``skipped``)."""
    _installed.cache_clear()  # distributions may have changed since the last check
    _extra_requirements.cache_clear()
    out = []
    for line in parse_requirements(text, source, label):
        req = line.requirement
        if req.marker is not None and not req.marker.evaluate():
            out.append(Status(line, _installed(req.name), True, skipped=True))
            continue
        have = _installed(req.name)
        ok = have is not None and _satisfies(req, have)
        detail = ""
        if ok and req.extras:
            missing = _extras_unmet(req)
            if missing:
                ok, detail = False, "; needs " + ", ".join(missing)
        out.append(Status(line, have, ok, detail=detail))
    return out


def ensure_requirements(text: str, label: str, source: str = "custom_generate/requirements.txt",
                        name: str | None = None) -> list[Status]:
    """Raise one :class:`RequirementsError` listing every unmet line; return the statuses otherwise.

    The message reads as transformers' does: ``Missing requirements in your local environment for
    `NAME`:`` then one ``requirement (installed: version or None)`` line per unmet requirement, then
    a shell-quoted ``pip install`` command that installs them."""
    statuses = check_requirements(text, source, label)
    unmet = [s for s in statuses if not s.ok]
    if unmet:
        wanted = [f"{canonicalize_name(s.line.requirement.name)}"
                  f"{'[' + ','.join(sorted(s.line.requirement.extras)) + ']' if s.line.requirement.extras else ''}"
                  f"{s.line.requirement.specifier}" for s in unmet]
        raise RequirementsError(
            f"Missing requirements in your local environment for `{name or label}`:\n"
            + "\n".join(str(s) for s in unmet)
            + f"\n(from {source} of {label}; install them with: {shlex.join(['pip', 'install', *wanted])})"
        )
    return statuses
