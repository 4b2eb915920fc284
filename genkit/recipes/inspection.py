"""``genkit inspect REF``: what a recipe is and what its code does, without running it.

For a Hub repo nothing is written to disk and nothing is imported: the file listing comes from the
tree endpoint, and README.md, requirements.txt and the ``.py`` files of custom_generate/ are read
into memory through the resolve URL (files over the size limit are not read). The sources are then
parsed (never executed) for the import rules, the ``generate(model, ...)`` signature and the audit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genkit.sandbox import (
    Finding,
    Problem,
    SandboxError,
    SourceTree,
    audit_tree,
    check_source,
    content_hash,
    scan_tree,
)
from genkit.sandbox.tree import FOLDER, MAX_FILE_BYTES, check_relpath

from .requirements import Status, check_requirements
from .validate import front_matter, readme_problems, signature_problems


@dataclass
class Inspection:
    ref: str
    commit: str | None
    files: list[tuple[str, int]] = field(default_factory=list)
    readme_meta: dict[str, Any] | None = None
    summary: str = ""
    problems: list[str] = field(default_factory=list)
    requirements: list[Status] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    def render(self) -> str:
        out = [f"recipe {self.ref}" + (f" @ {self.commit}" if self.commit else " (local folder)")]
        if self.readme_meta is not None:
            out.append(f"  tags: {', '.join(map(str, self.readme_meta.get('tags') or [])) or '-'}")
        if self.summary:
            out.append(f"  summary: {self.summary}")
        out.append("  files:")
        out += [f"    {p} ({n} bytes)" for p, n in self.files]
        out.append("  requirements:" + ("" if self.requirements else " none"))
        out += [f"    {'ok   ' if s.ok else 'UNMET'} {s}{' [marker does not apply]' if s.skipped else ''}"
                for s in self.requirements]
        out.append("  problems:" + ("" if self.problems else " none"))
        out += [f"    {p}" for p in self.problems]
        out.append("  audit (imports and calls worth reading):" + ("" if self.findings else " none"))
        out += [f"    {f}" for f in self.findings]
        return "\n".join(out)


def _summary(readme: str | None) -> str:
    if not readme:
        return ""
    from .validate import FRONT_MATTER

    body = FRONT_MATTER.sub("", readme, count=1)
    paras = [p.strip() for p in body.split("\n\n") if p.strip() and not p.strip().startswith(("#", "```"))]
    return " ".join(paras[0].split())[:400] if paras else ""


def _analyse(result: Inspection, tree: SourceTree) -> None:
    parsed, problems = check_source(tree)
    result.problems += [str(p) for p in signature_problems(parsed, tree.files) + problems]
    result.findings = audit_tree(tree, parsed)
    req = tree.files.get("requirements.txt")
    if req is not None:
        try:
            result.requirements = check_requirements(req.decode("utf-8", "replace"))
        except ValueError as exc:
            result.problems.append(str(exc))


def inspect_recipe(ref: str, revision: str | None = None) -> Inspection:
    """Inspect a local folder or a Hub recipe without executing or writing any of its code."""
    from .resolve import parse_ref, resolve_commit

    parsed = parse_ref(ref, revision)
    if parsed.kind == "local":
        assert parsed.path is not None
        result = Inspection(ref, None)
        readme = parsed.path / "README.md"
        text = None
        if readme.is_file():
            with open(readme, "rb") as fh:  # bounded: a local README can be any size too
                text = fh.read(MAX_README_BYTES).decode("utf-8", "replace")
        result.readme_meta, result.summary = (front_matter(text) if text else None), _summary(text)
        result.problems += readme_problems(text)
        try:
            tree = scan_tree(parsed.path)
        except SandboxError as exc:
            result.problems += [str(p) for p in exc.problems]
            return result
        result.files = [(f"{FOLDER}/{p}", len(d)) for p, d in sorted(tree.files.items())]
        _analyse(result, tree)
        return result
    return _inspect_hub(parsed, resolve_commit(parsed))


MAX_README_BYTES = 256_000


def _read(repo_id: str, commit: str, path: str, size: int) -> bytes:
    """The file's bytes, streamed and cut off at the ``size`` its listing gives: a server that sends
    more (a body longer than listed) gets an error, not unbounded memory."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from genkit.sandbox.errors import Problem, SandboxError

    from .hub import with_retries
    from .settings import hub_endpoint, hub_timeout

    url = hf_hub_url(repo_id, path, revision=commit, endpoint=hub_endpoint())

    def get() -> bytes:
        with get_session().stream("GET", url, headers=build_hf_headers(), timeout=hub_timeout(),
                                  follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > size:
                    raise SandboxError([Problem(path, None, f"the Hub sent more than the {size} bytes its listing "
                                                            "gives; not read further")], where=f"Hub recipe {repo_id}")
                chunks.append(chunk)
            return b"".join(chunks)

    return with_retries(f"reading {path} of", repo_id, get)


def _inspect_hub(parsed: Any, commit: str) -> Inspection:
    from .fetch import list_files

    repo_id = parsed.repo_id
    result = Inspection(parsed.ref, commit)
    listing = list_files(repo_id, commit)
    result.files = [(p, m["size"]) for p, m in sorted(listing.items())]
    readme = None
    if "README.md" in listing:
        size = listing["README.md"]["size"]
        if not isinstance(size, int) or not 0 <= size <= MAX_README_BYTES:
            result.problems.append(f"README.md: {size} bytes, over the {MAX_README_BYTES}-byte limit (not read)")
        else:
            readme = _read(repo_id, commit, "README.md", size).decode("utf-8", "replace")
    result.readme_meta, result.summary = (front_matter(readme) if readme else None), _summary(readme)
    if readme is not None or "README.md" not in listing:
        result.problems += readme_problems(readme)
    files: dict[str, bytes] = {}
    problems: list[Problem] = []
    for path, meta in sorted(listing.items()):
        if not path.startswith(f"{FOLDER}/"):
            continue
        why = check_relpath(path)
        if why:
            problems.append(Problem(path, None, why))
            continue
        if meta["size"] > MAX_FILE_BYTES:
            problems.append(Problem(path, None, f"{meta['size']} bytes, over the {MAX_FILE_BYTES}-byte limit (not read)"))
            continue
        rel = path[len(FOLDER) + 1:]
        if rel.endswith(".py") or rel == "requirements.txt":
            data = _read(repo_id, commit, path, meta["size"])
            if rel.endswith(".py") and (b"\x00" in data):
                problems.append(Problem(path, None, "binary content in a Python file"))
                continue
            files[rel] = data
    result.problems += [str(p) for p in problems]
    outside = frozenset(p.split("/")[0].removesuffix(".py") for p in listing
                        if not p.startswith(f"{FOLDER}/") and p != "README.md" and not p.startswith("."))
    tree = SourceTree(Path(os.devnull).parent / f"<{repo_id}@{commit}>", files, content_hash(files), outside)
    _analyse(result, tree)
    return result
