"""``genkit inspect REF``: what a recipe is and what its code does, without running it.

For a Hub repo nothing is written to disk and nothing is imported: the file listing comes from the
tree endpoint and is checked as the loader checks it; then the listed files of custom_generate/ and
README.md are read into memory through the resolve URL, each cut off at its listed size (a listing
over the limits is reported and nothing is read). The sources are then parsed (never executed) for
the import rules, the ``generate(model, ...)`` signature and the audit, by the loader's own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genkit.sandbox import Finding

from .pipeline import MAX_README_BYTES
from .requirements import Status
from .validate import front_matter, readme_problems


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


def inspect_recipe(ref: str, revision: str | None = None) -> Inspection:
    """Inspect a local folder or a Hub recipe without executing or writing any of its code.

    The steps are the loader's (:mod:`genkit.recipes.pipeline`) up to requirements, collecting
    problems instead of raising: a Hub commit is listed once, the listing checked, and only listed
    files within the limits are read, into memory, each bounded by its listed size."""
    from . import pipeline
    from .hub import recipe_deadline

    with recipe_deadline():  # every Hub request: GENKIT_RECIPE_FETCH_TIMEOUT seconds in all
        parsed, commit = pipeline.resolve(ref, revision)
        source = pipeline.read(parsed, commit, store=False, strict=False, readme_limit=MAX_README_BYTES)
    result = Inspection(ref, commit, files=source.listing)
    result.readme_meta = front_matter(source.readme) if source.readme else None
    result.summary = _summary(source.readme)
    result.problems += source.notes
    if source.readme is not None or not any(p == "README.md" for p, _ in source.listing):
        result.problems += readme_problems(source.readme)
    result.problems += [str(p) for p in source.problems]
    checked = pipeline.validate(source, strict=False)
    result.problems += [str(p) for p in checked.problems]
    result.findings = checked.findings
    result.requirements, errors = pipeline.requirements(source, enforce=False)
    result.problems += errors
    return result

