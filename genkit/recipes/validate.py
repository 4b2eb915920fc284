"""Step 4: structural checks on a scanned recipe, by reading its AST (nothing is executed):
``custom_generate/generate.py`` defines ``generate`` whose first parameter is ``model``; import
rules from :mod:`sandbox`; README front matter (for ``genkit check`` / ``publish``)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from genkit.sandbox import Finding, Problem, SandboxError, SourceTree, audit_tree, check_source
from genkit.sandbox.tree import FOLDER

FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", re.DOTALL)
TAG = "custom_generate"


@dataclass(frozen=True)
class Checked:
    tree: SourceTree
    parsed: dict[str, ast.Module]
    findings: list[Finding]


def _generate_def(parsed: dict[str, ast.Module], rel: str, seen: set[str]) -> tuple[ast.AST | None, str]:
    """The node that binds ``generate`` at the top of ``rel`` (following ``from .x import generate``)."""
    module = parsed.get(rel)
    if module is None or rel in seen:
        return None, rel
    seen.add(rel)
    found: tuple[ast.AST | None, str] = (None, rel)
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "generate":
            found = (node, rel)
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == "generate" and alias.name == "generate":
                    target = node.module.replace(".", "/") + ".py"
                    sub, where = _generate_def(parsed, target, seen)
                    found = (sub, where) if sub is not None else (node, rel)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "generate" for t in node.targets):
            found = (node, rel)
    return found


def signature_problems(parsed: dict[str, ast.Module], files: dict[str, bytes]) -> list[Problem]:
    path = f"{FOLDER}/generate.py"
    if "generate.py" not in files:
        return [Problem(path, None, "missing: a recipe's entry point is custom_generate/generate.py")]
    if "generate.py" not in parsed:
        return []  # syntax error already reported
    node, where = _generate_def(parsed, "generate.py", set())
    if node is None:
        return [Problem(path, None, "defines no top-level function `generate(model, **kwargs)`")]
    if isinstance(node, ast.AsyncFunctionDef):
        return [Problem(f"{FOLDER}/{where}", node.lineno, "`generate` must be a plain function, not async")]
    if not isinstance(node, ast.FunctionDef):
        return [Problem(f"{FOLDER}/{where}", getattr(node, "lineno", None),
                        "`generate` must be defined with `def generate(model, ...)` so its signature can be checked "
                        "without running the recipe")]
    positional = node.args.posonlyargs + node.args.args
    if not positional or positional[0].arg != "model":
        got = positional[0].arg if positional else ("*" + node.args.vararg.arg if node.args.vararg else "nothing")
        return [Problem(f"{FOLDER}/{where}", node.lineno,
                        f"the first parameter of generate() must be `model`; found {got}")]
    return []


def validate(tree: SourceTree, label: str) -> Checked:
    """All structural problems in one :class:`SandboxError`, or the parsed tree + audit findings."""
    parsed, problems = check_source(tree)
    problems = signature_problems(parsed, tree.files) + problems
    if problems:
        raise SandboxError(problems, where=label)
    return Checked(tree, parsed, audit_tree(tree, parsed))


def readme_problems(text: str | None) -> list[str]:
    """What is wrong with a recipe README (front matter with the ``custom_generate`` tag)."""
    if text is None:
        return ["README.md is missing; it should start with front matter carrying `tags: [custom_generate]`"]
    meta = front_matter(text)
    if meta is None:
        return ["README.md has no YAML front matter (--- ... ---) with `tags: [custom_generate]`"]
    tags = _tags(meta)
    if tags is None:
        return [f"README.md front matter: `tags` must be a list of names; got {type(meta.get('tags')).__name__}"]
    if TAG not in tags:
        return ["README.md front matter does not carry the `custom_generate` tag"]
    return []


def _tags(meta: dict) -> list[str] | None:
    """The front matter's tags as a list of strings (a single string is one tag); None when they
    are something else (a number, a mapping)."""
    tags = meta.get("tags") or []
    if isinstance(tags, str):
        return [tags]
    if not isinstance(tags, list):
        return None
    return [str(t) for t in tags]


MAX_FRONT_MATTER_BYTES = 64_000
MAX_FRONT_MATTER_DEPTH = 32


def _safe_loader() -> type:
    """A ``yaml.SafeLoader`` that refuses aliases (``*name``) and nesting deeper than
    :data:`MAX_FRONT_MATTER_DEPTH`: a few hundred bytes of nested aliases (an "alias bomb") build a
    structure that is tiny in memory but expands exponentially when it is walked or printed, and a
    few KB of ``[[[[...`` exhaust the recursion of PyYAML's composer and of anything that walks the
    result (``json.dumps``). README front matter has no use for either."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, "YAML aliases are not allowed in README front matter",
                                                  event.start_mark)
            if self.depth >= MAX_FRONT_MATTER_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"README front matter is nested deeper than "
                                                  f"{MAX_FRONT_MATTER_DEPTH} levels", self.peek_event().start_mark)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return BoundedLoader


def front_matter(text: str) -> dict | None:
    """The README's YAML front matter as a dict, or None when it has none, it is not a mapping, it
    is over :data:`MAX_FRONT_MATTER_BYTES`, it uses YAML aliases or it is nested deeper than
    :data:`MAX_FRONT_MATTER_DEPTH`."""
    import yaml

    m = FRONT_MATTER.match(text)
    if not m or len(m.group(1).encode("utf-8", "replace")) > MAX_FRONT_MATTER_BYTES:
        return None
    try:
        data = yaml.load(m.group(1), Loader=_safe_loader()) or {}  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError):
        return None
    return _plain(data) if isinstance(data, dict) else None


def _plain(value: Any) -> Any:
    """The parsed front matter with only JSON types: mapping keys as strings, dates and binary
    values as their text (``genkit inspect --json`` prints it; depth is bounded by the loader)."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


def with_tag(text: str | None, title: str = "Recipe") -> str:
    """``text`` with ``custom_generate`` added to its front-matter tags (front matter created if absent)."""
    import yaml

    if text is None:
        text = f"# {title}\n"
    m = FRONT_MATTER.match(text)
    meta = front_matter(text) if m else {}
    if meta is None:
        meta = {}
    tags = _tags(meta) or []
    if TAG in tags and m:
        return text
    meta["tags"] = tags + [TAG]
    body = text[m.end():] if m else text
    return "---\n" + yaml.safe_dump(meta, sort_keys=False).strip() + "\n---\n" + body
