"""One error hierarchy: every error genkit raises on purpose is a GenkitError and keeps the builtin
base a caller would catch without knowing genkit; the CLI catches the root."""

from __future__ import annotations

import pytest
import torch
from hub_server import write_recipe

import genkit
from genkit.cli import main
from genkit.errors import ConfigError, GenkitError, PluginError, RecipeError, UnknownItemError
from genkit.recipes import load_recipe
from genkit.recipes.errors import RecipeValidationError, RequirementsError


def test_config_errors(tiny_model):
    ids = torch.tensor([[1, 5, 6]])
    with pytest.raises(ConfigError, match=r"`max_new_tokenz` is not a generation parameter .*Did you mean "
                                          r"`max_new_tokens`\?") as err:
        genkit.generate(tiny_model, ids, max_new_tokenz=3)
    assert isinstance(err.value, ValueError) and isinstance(err.value, GenkitError)
    with pytest.raises(ConfigError, match="`dry_bse` is not a generation parameter"):
        genkit.generate(tiny_model, ids, dry_bse=1)


def test_unknown_item_errors(tiny_model):
    with pytest.raises(UnknownItemError, match=r"`custom_generate`='no_such_strategy' is not a registered strategy"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="no_such_strategy")
    with pytest.raises(UnknownItemError, match=r"unknown streamer 'nope'; registered: .*iterator") as err:
        genkit.get_registry().get("streamer", "nope")
    assert isinstance(err.value, ValueError)


def test_recipe_errors_keep_their_builtin_bases(tmp_path):
    root = write_recipe(tmp_path / "bad", {"custom_generate/generate.py": "from ..outside import x\n"
                                                                          "def generate(model, **kw):\n    pass\n"})
    with pytest.raises(RecipeValidationError) as err:
        load_recipe(str(root))
    assert isinstance(err.value, RecipeError) and isinstance(err.value, ValueError)
    root = write_recipe(tmp_path / "req", {"custom_generate/generate.py": "def generate(model, **kw):\n    pass\n",
                                           "custom_generate/requirements.txt": "torch>=999\n"})
    with pytest.raises(RequirementsError, match=r"torch>=999 \(installed: ") as err:
        load_recipe(str(root))
    assert isinstance(err.value, RecipeError) and isinstance(err.value, ImportError)
    assert issubclass(PluginError, GenkitError) and issubclass(PluginError, RuntimeError)


def test_the_cli_catches_the_root(capsys):
    """A GenkitError raised deep in generate() (here a misspelt --set key) reaches the user as one
    line, exit status 2."""
    rc = main(["generate", "--prompt", "hi", "--max-new-tokens", "2", "--set", "max_new_tokenz=1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines()[-1] == ("genkit: error: `max_new_tokenz` is not a generation parameter "
                                            "(GenerationConfig field or model input). Did you mean `max_new_tokens`?")


# -- every error a user can trigger is typed (issue 26, item 8) -------------------------------------

_BARE = ("ValueError", "TypeError", "RuntimeError")
_ROOTS = ("genkit", "builtin_strategies", "sandbox")

#: (file, enclosing function, exception) -> why a bare builtin is right there
ALLOWED_BARE_RAISES: dict[tuple[str, str, str], str] = {
}


def _bare_raises(path, rel):
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, f"{scope}.{child.name}" if scope else child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in _BARE:
                    found.append((rel, scope or "<module>", exc.id, child.lineno))
            visit(child, scope)

    visit(tree, "")
    return found


def test_no_bare_builtin_raise_outside_the_allow_list():
    """``raise ValueError(...)`` (or ``TypeError`` / ``RuntimeError``) appears only where a builtin
    protocol demands it, each place listed with its reason; every other error is a GenkitError
    subclass named for what went wrong (genkit/errors.py)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    found = []
    for root in _ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            found += _bare_raises(path, path.relative_to(repo).as_posix())
    unexpected = [f"{rel}:{line} {scope}: raise {exc}" for rel, scope, exc, line in found
                  if (rel, scope, exc) not in ALLOWED_BARE_RAISES]
    assert not unexpected, "raise a genkit.errors subclass instead:\n" + "\n".join(unexpected)
    stale = set(ALLOWED_BARE_RAISES) - {(rel, scope, exc) for rel, scope, exc, _ in found}
    assert not stale, f"allow-list entries with no such raise left: {sorted(stale)}"


def test_typed_errors_keep_their_builtin_bases(tiny_model):
    from genkit.errors import (
        ArgumentTypeError,
        CorruptModelError,
        GenerationError,
        InvalidStateError,
        KernelUnavailableError,
        ModelLoadError,
        NotSupportedError,
        UnsupportedModelError,
    )

    assert issubclass(CorruptModelError, ModelLoadError) and issubclass(CorruptModelError, ValueError)
    assert issubclass(UnsupportedModelError, OSError) and issubclass(UnsupportedModelError, ValueError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ConfigError)
    for cls in (KernelUnavailableError, GenerationError, InvalidStateError):
        assert issubclass(cls, GenkitError) and issubclass(cls, RuntimeError)
    with pytest.raises(ConfigError, match="'beam' is not a valid GenerationMode; choose one of"):
        genkit.GenerationMode("beam")
    with pytest.raises(NotSupportedError, match="assisted decoding supports batch size 1; got input_ids with batch size 2"):
        genkit.generate(tiny_model, torch.tensor([[1, 5, 6], [1, 7, 8]]), prompt_lookup_num_tokens=2,
                        max_new_tokens=2)
