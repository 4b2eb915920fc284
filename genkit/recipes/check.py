"""``genkit check``: everything a recipe must pass before it is published — structure, signature,
import rules, requirements, README front matter — then a smoke run on a tiny random model (its runner is passed in:
:func:`genkit.generation.smoke.smoke_run`, a layer above this package)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from genkit.sandbox import Finding

from .requirements import Status
from .validate import readme_problems


@dataclass
class CheckReport:
    """What ``check_recipe`` found; ``ok`` when there are no errors (warnings do not block)."""

    path: Path
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    requirements: list[Status] = field(default_factory=list)
    smoke: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors

    def render(self) -> str:
        lines = [f"recipe {self.path}: {'OK' if self.ok else 'FAILED'}"]
        lines += [f"  error: {e}" for e in self.errors]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  requirement: {s}{' [skipped: marker]' if s.skipped else ''}" for s in self.requirements]
        lines += [f"  audit: {f}" for f in self.findings]
        if self.smoke:
            lines.append(f"  smoke run: {self.smoke}")
        return "\n".join(lines)


#: ``smoke(root, report) -> str``: runs the recipe in ``root``, appends its errors to ``report.errors``
#: and describes what happened (:func:`genkit.generation.smoke.smoke_run`)
SmokeRun = Callable[[Path, CheckReport], str]


def check_recipe(path: str | os.PathLike[str], *, smoke: SmokeRun | None = None,
                 trust_remote_code: bool = False) -> CheckReport:
    """Check a local recipe folder with the loader's own steps (:mod:`genkit.recipes.pipeline`),
    collecting problems instead of raising; then ``smoke(root, report)`` runs it (``None`` or
    ``False``: no smoke run). The smoke run happens only when every static check passed and the
    trust gate lets the folder run: when local recipes need trust
    (``GENKIT_TRUST_LOCAL_RECIPES=0`` or the settings file), only with ``trust_remote_code=True``."""
    from . import pipeline
    from .errors import RecipeTrustError

    root = Path(os.path.abspath(os.fspath(path)))
    report = CheckReport(root)
    if not root.is_dir():
        report.errors.append(f"{root} is not a folder")
        return report
    parsed, _ = pipeline.resolve(root)
    source = pipeline.read(parsed, None, strict=False)
    if source.problems:
        report.errors += [str(p) for p in source.problems]
        return report
    checked = pipeline.validate(source, strict=False)
    report.findings = checked.findings
    if checked.problems:
        report.errors += [str(p) for p in checked.problems]
        return report
    if "requirements.txt" not in source.tree.files:
        report.warnings.append("custom_generate/requirements.txt is missing (fine if the recipe needs only genkit)")
    report.requirements, errors = pipeline.requirements(source, enforce=False)
    report.errors += errors + [f"unmet requirement: {s}" for s in report.requirements if not s.ok]
    report.warnings += readme_problems(source.readme)
    if smoke and report.ok:
        try:
            pipeline.gate(parsed, None, True if trust_remote_code else None)
        except RecipeTrustError:
            report.warnings.append("smoke run skipped: local recipes need trust here (GENKIT_TRUST_LOCAL_RECIPES or "
                                   "\"trust_local_recipes\" in settings.json); read the code, then pass "
                                   "--trust-remote-code to run it")
            report.smoke = "not run (needs trust)"
        else:
            report.smoke = smoke(root, report)
    return report
