"""issue 28, recipe trees: a package's __path__ cannot reach outside custom_generate/; symlink
loops and dangling links are recipe errors; Hub ids that would share a cache folder are refused;
bidirectional control characters (Trojan Source) are flagged by the loader and `genkit inspect`;
deeply nested code is a recipe error, not a RecursionError; a BOM in requirements.txt is accepted."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hub_server import write_recipe

import genkit
from genkit.cli import main as cli
from genkit.errors import RecipeError
from genkit.recipes.requirements import parse_requirements
from genkit.recipes.resolve import parse_ref
from genkit.sandbox import SandboxError, audit_sources, scan_tree

PLAIN = "def generate(model, inputs=None, **kwargs):\n    return 'plain'\n"


def _run(root, model):
    return genkit.generate(model, torch.tensor([[1, 2]]), custom_generate=str(root))


def test_a_package_path_change_cannot_import_from_outside(tmp_path, tiny_model):
    outside = tmp_path / "outside"
    outside.mkdir()
    marker = tmp_path / "ran"
    (outside / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nVALUE = 'outside'\n")
    root = write_recipe(tmp_path / "r", {
        "custom_generate/__init__.py": f"__path__.append({str(outside)!r})\n",
        "custom_generate/generate.py": "def generate(model, inputs=None, **kwargs):\n"
                                       "    import importlib\n"
                                       "    return importlib.import_module(__package__ + '.evil').VALUE\n"})
    with pytest.raises(ModuleNotFoundError, match=r"custom_generate/ has no evil\.py"):
        _run(root, tiny_model)
    assert not marker.exists()
    assert not any("evil" in name for name in sys.modules)


@pytest.mark.parametrize("kind", ["loop", "dangling", "self"])
def test_symlink_loops_and_dangling_links_are_recipe_errors(tmp_path, tiny_model, kind):
    root = write_recipe(tmp_path / kind, {"custom_generate/generate.py": PLAIN}, readme="")
    folder = root / "custom_generate"
    if kind == "loop":
        os.symlink("b.py", folder / "a.py")
        os.symlink("a.py", folder / "b.py")
    elif kind == "self":
        os.symlink("me.py", folder / "me.py")
    else:
        os.symlink("gone.py", folder / "a.py")
    with pytest.raises(SandboxError, match=r"a dangling symlink or a loop of symlinks") as err:
        scan_tree(root)
    assert isinstance(err.value, RecipeError)
    with pytest.raises(RecipeError, match=r"custom_generate/(a|me)\.py: cannot be read"):
        _run(root, tiny_model)


@pytest.mark.parametrize("ref", ["a--b/c", "a/b--c", "a--b/c@main"])
def test_hub_ids_that_would_share_a_cache_folder_are_refused(ref):
    with pytest.raises(ValueError, match=r"'--' is not allowed in a Hub id"):
        parse_ref(ref)
    assert parse_ref("a-b/c-d").repo_id == "a-b/c-d"


TROJAN = ('def generate(model, inputs=None, **kwargs):\n    access = "user"\n'
          '    if access != "user\u202e \u2066# admin\u2069 \u2066":\n        return "admin"\n    return "user"\n')


@pytest.mark.parametrize("char", ["\u202a", "\u202e", "\u2066", "\u2069", "\u200e", "\u200f", "\u061c"])
def test_bidi_controls_are_flagged_by_the_loader(tmp_path, tiny_model, char):
    root = write_recipe(tmp_path / f"b{ord(char)}", {"custom_generate/generate.py": PLAIN + f"# {char}\n"})
    with pytest.raises(RecipeError, match=rf"generate\.py:3: bidirectional control character U\+{ord(char):04X}"):
        _run(root, tiny_model)


def test_inspect_flags_trojan_source(tmp_path, capsys):
    root = write_recipe(tmp_path / "trojan", {"custom_generate/generate.py": TROJAN})
    cli(["inspect", str(root)])
    out = capsys.readouterr().out
    assert "custom_generate/generate.py:3: bidirectional control character U+202E" in out
    assert "Trojan Source" in out


@pytest.mark.parametrize("code", ["x = " + "+".join(["1"] * 20_000) + "\n",
                                  "x = " + "-" * 5000 + "1\n",
                                  "f = " + "lambda: " * 3000 + "1\n", "x = " + "not " * 600 + "1\n"])
def test_deeply_nested_code_is_a_recipe_error(tmp_path, tiny_model, capsys, code):
    root = write_recipe(tmp_path / "deep", {"custom_generate/generate.py": PLAIN,
                                            "custom_generate/deep.py": code})
    with pytest.raises(RecipeError, match=r"custom_generate/deep\.py.*nested deeper than"):
        _run(root, tiny_model)
    cli(["inspect", str(root)])
    assert "deep.py" in capsys.readouterr().out and "nested deeper than" in str(_problems(root))
    assert audit_sources({"deep.py": code}) == []


def _problems(root):
    from genkit.recipes.inspection import inspect_recipe
    return inspect_recipe(str(root)).problems


def test_a_bom_in_requirements_is_accepted(tmp_path, tiny_model):
    lines = parse_requirements("\ufefftorch>=1.0\n# comment\n")
    assert [line.text for line in lines] == ["torch>=1.0"]
    root = write_recipe(tmp_path / "bom", {"custom_generate/generate.py": PLAIN,
                                           "custom_generate/requirements.txt": b"\xef\xbb\xbftorch>=1.0\n"})
    assert _run(root, tiny_model) == "plain"
