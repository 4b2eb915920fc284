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
