"""One classifier for what ``custom_generate`` names (issue 26): ``genkit.recipes.reference.classify``,
used by ``generate``, the CLI, serve and batch, so all four agree on every reference."""

from __future__ import annotations

import pytest
import torch
from hub_server import write_recipe

import genkit
from genkit.errors import ConfigError, NotSupportedError, UnknownItemError
from genkit.recipes.reference import classify

PLAIN = "def generate(model, inputs=None, **kwargs):\n    return 'plain'\n"


def test_each_kind(tmp_path):
    folder = write_recipe(tmp_path / "r", {"custom_generate/generate.py": PLAIN})
    assert classify(None) is None
    assert classify(len).kind == "callable"
    assert classify("beam_search").kind == "strategy" and not classify("beam_search").is_recipe
    local = classify(str(folder))
    assert local.kind == "local" and local.is_recipe and local.recipe.path == folder
    hub = classify("org/repo@v1")
    assert hub.kind == "hub" and hub.recipe.repo_id == "org/repo" and hub.recipe.revision == "v1"
    assert classify(folder).kind == "local"  # a PathLike is a folder, not a callable


@pytest.mark.parametrize(("ref", "error", "message"), [
    ("./no/such/recipe", ConfigError, "`custom_generate`: the recipe folder './no/such/recipe' does not exist"),
    ("a/b/c", ConfigError, "the recipe folder 'a/b/c' does not exist"),
    ("no_such_strategy", UnknownItemError, "`custom_generate`='no_such_strategy' is not a registered strategy"),
    ("org/repo@", ConfigError, "`custom_generate`: recipe reference 'org/repo@' has an empty revision"),
    ("org/repo@a..b", ConfigError, "is not a valid git revision"),
    (3, ConfigError, "`custom_generate` must be a strategy name, a local folder, a Hub id"),
])
def test_what_names_nothing_is_an_error_naming_the_parameter(ref, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(".", r"\.")):
        classify(ref)


def test_generate_and_the_cli_agree(tiny_model, tmp_path, capsys):
    """A bad Hub revision: generate and the CLI (before the model loads) say the same thing; a
    strategy name with the paged cache is refused naming custom_generate, not run without it."""
    from genkit.cli import main

    with pytest.raises(ConfigError, match="`custom_generate`: recipe reference 'org/repo@' has an empty revision"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="org/repo@")
    assert main(["generate", "--model", str(tmp_path / "absent"), "--prompt", "hi",
                 "--custom-generate", "org/repo@"]) == 2
    assert "--custom-generate: recipe reference 'org/repo@' has an empty revision" in capsys.readouterr().err
    with pytest.raises(NotSupportedError, match="`custom_generate` is set"):
        genkit.generate(tiny_model, torch.tensor([[1, 2]]), custom_generate="greedy", cache_implementation="paged",
                        max_new_tokens=2)


def test_batch_refuses_a_bad_reference_before_any_row(tiny_model):
    from genkit.batch import make_local_engine

    with pytest.raises(UnknownItemError, match="`custom_generate`='no_such' is not a registered strategy"):
        make_local_engine(tiny_model, None, {}, custom_generate="no_such")
