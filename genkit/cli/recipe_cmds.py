"""``genkit new`` / ``check`` / ``publish`` / ``inspect``: write, test, share and read recipes.

Nothing here imports torch at import time; each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import ConfigError
from .options import add_threads_option, apply_threads_option


def add_parser(subparsers: Any) -> None:
    """Add the four recipe sub-commands to the ``genkit`` parser."""
    p = subparsers.add_parser("new", help="scaffold a recipe folder (custom_generate/ layout)",
                              description="Create NAME/ with custom_generate/generate.py, requirements.txt, a "
                                          "README.md tagged custom_generate and a test.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--dir", default=".", help="parent folder (default: current folder)")
    p.add_argument("--force", action="store_true", help="write into an existing, non-empty folder")
    p.set_defaults(func=cmd_new)

    p = subparsers.add_parser("check", help="validate a recipe folder and smoke-run it on a tiny model",
                              description="Check structure, the generate(model, ...) signature, import rules, "
                                          "requirements and README front matter, then run the recipe on "
                                          "genkit.models.tiny.tiny_llama. Exit status 1 when anything failed.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke run")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow the smoke run where local recipes need trust (GENKIT_TRUST_LOCAL_RECIPES=0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_threads_option(p)
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser("publish", help="check a recipe folder, then upload it to the Hub",
                              description="Run `genkit check`, then HfApi.create_repo + upload_folder; the README "
                                          "gets the custom_generate tag if it lacks it. Uses HF_ENDPOINT/HF_TOKEN.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("repo_id", metavar="ORG/NAME")
    p.add_argument("--revision", default=None, metavar="BRANCH", help="branch to commit to (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("-m", "--message", default=None, help="commit message")
    p.add_argument("--no-smoke", action="store_true", help="skip the smoke run of the check")
    add_threads_option(p)
    p.set_defaults(func=cmd_publish)

    p = subparsers.add_parser("inspect", help="show a recipe's README, files, requirements and audit without "
                                             "running it",
                              description="REF is a local folder or org/repo[@revision]. For a Hub repo nothing "
                                          "is executed or written to disk: sources are read into memory.")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)


def cmd_new(args: argparse.Namespace) -> int:
    from ..recipes.scaffold import new_recipe

    try:
        root = new_recipe(args.name, args.dir, force=args.force)
    except FileExistsError as exc:
        print(f"genkit: error: {exc}", file=sys.stderr)
        return 2
    print(f"created {root}/ (custom_generate/generate.py, custom_generate/requirements.txt, README.md, "
          f"tests/test_recipe.py)\nnext: genkit check {root}")
    return 0


def _smoke(args: argparse.Namespace) -> Any:
    """The smoke run ``genkit check`` / ``genkit publish`` do (none with ``--no-smoke``, where
    ``--threads`` would set nothing: refused)."""
    if args.no_smoke:
        if args.threads is not None:
            raise ConfigError("--threads applies to the smoke run, which --no-smoke leaves out")
        return None
    from ..generation.smoke import smoke_run

    return smoke_run


def cmd_check(args: argparse.Namespace) -> int:
    from ..recipes.check import check_recipe

    smoke = _smoke(args)
    if smoke is not None:
        apply_threads_option(args)
    report = check_recipe(args.path, smoke=smoke, trust_remote_code=args.trust_remote_code)
    if args.json:
        print(json.dumps({"path": str(report.path), "ok": report.ok, "errors": report.errors,
                          "warnings": report.warnings, "audit": [str(f) for f in report.findings],
                          "requirements": [str(s) for s in report.requirements], "smoke": report.smoke}, indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1


def cmd_publish(args: argparse.Namespace) -> int:
    from ..recipes.publish import RecipeCheckFailed, publish_recipe

    smoke = _smoke(args)
    if smoke is not None:
        apply_threads_option(args)
    try:
        done = publish_recipe(args.path, args.repo_id, revision=args.revision, private=args.private,
                              commit_message=args.message, smoke=smoke)
    except RecipeCheckFailed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"published {args.path} to {done.url} (revision {done.revision}, commit {done.commit})\n"
          f"use it: genkit.generate(model, ..., custom_generate='{done.repo_id}@{done.commit}', "
          "trust_remote_code=True)")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..recipes.inspection import inspect_recipe

    result = inspect_recipe(args.ref)
    if args.json:
        print(json.dumps({"ref": result.ref, "commit": result.commit, "files": result.files,
                          "front_matter": result.readme_meta, "summary": result.summary,
                          "problems": result.problems, "requirements": [str(s) for s in result.requirements],
                          "requirements_ok": all(s.ok for s in result.requirements),
                          "audit": [str(f) for f in result.findings]}, indent=2, default=str))
    else:
        print(result.render())
    return 0
