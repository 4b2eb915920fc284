"""genkit new / check / inspect on local folders (publish and Hub inspect: tests/test_hub_recipes.py),
and running local recipes through genkit.generate."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import write_recipe

import genkit
from genkit.cli import main as cli

DEMO = Path(__file__).resolve().parents[1] / "docs" / "examples" / "demo_recipe"


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path / "genkit_home"))
    monkeypatch.delenv("GENKIT_TRUST_LOCAL_RECIPES", raising=False)


def test_new_scaffolds_a_recipe_that_passes_check_and_its_own_test(tmp_path, capsys):
    assert cli(["new", "my-recipe", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "my-recipe"
    for rel in ("custom_generate/generate.py", "custom_generate/requirements.txt", "README.md",
                "tests/test_recipe.py"):
        assert (root / rel).is_file(), rel
    readme = (root / "README.md").read_text()
    assert readme.startswith("---\n") and "- custom_generate" in readme
    assert "## Arguments" in readme and "## Output differences" in readme
    capsys.readouterr()
    assert cli(["check", str(root)]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "smoke run: returned Tensor with sequences of shape (1, 8)" in out
    # the scaffolded test passes as written
    spec = importlib.util.spec_from_file_location("scaffold_test", root / "tests" / "test_recipe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_recipe_runs_and_avoids_recent_repeats()
    # a second `new` with the same name refuses to overwrite; bad names are refused
    assert cli(["new", "my-recipe", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli(["new", "../escape", "--dir", str(tmp_path)]) == 2
    assert "must start with a letter" in capsys.readouterr().err


def test_check_reports_problems_and_fails(tmp_path, capsys):
    root = write_recipe(tmp_path / "bad", {
        "custom_generate/generate.py": "from ..up import x\n\ndef generate(ids):\n    pass\n",
        "custom_generate/requirements.txt": "git+https://example.com/x.git\n"}, readme="# no front matter\n")
    assert cli(["check", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any("generate.py:3: the first parameter of generate() must be `model`" in e for e in report["errors"])
    assert any("generate.py:1: `from ..up import ...` leaves custom_generate/" in e for e in report["errors"])
    assert report["smoke"] == ""  # no smoke run when static checks fail

    root2 = write_recipe(tmp_path / "raises", {
        "custom_generate/generate.py": "def generate(model, **kwargs):\n    raise RuntimeError('kaput')\n",
        "custom_generate/requirements.txt": "torch>=2\ngit+https://example.com/x.git\n"})
    assert cli(["check", str(root2)]) == 1
    assert "requirements.txt:2" in capsys.readouterr().out
    (root2 / "custom_generate" / "requirements.txt").write_text("torch>=2\n")
    assert cli(["check", str(root2)]) == 1
    out = capsys.readouterr().out
    assert "smoke run on genkit.models.tiny.tiny_llama raised RuntimeError: kaput" in out
    assert cli(["check", str(tmp_path / "nothing-here")]) == 1


def test_check_warns_about_missing_tag_but_passes(tmp_path, capsys):
    root = write_recipe(tmp_path / "untagged", {
        "custom_generate/generate.py": "import genkit\n\ndef generate(model, **kwargs):\n"
                                       "    return genkit.generate(model, **kwargs)\n"}, readme="# hi\n")
    assert cli(["check", str(root)]) == 0
    out = capsys.readouterr().out
    assert "warning: README.md has no YAML front matter" in out
    assert "warning: custom_generate/requirements.txt is missing" in out


def test_inspect_local_folder_runs_nothing(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "ran"
    root = write_recipe(tmp_path / "spy", {
        "custom_generate/generate.py": f"import os\nopen({str(marker)!r}, 'w').close()\nos.system('true')\n\n"
                                       "def generate(model, **kwargs):\n    pass\n"})
    assert cli(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "custom_generate/generate.py:2: [filesystem] open(..., 'w')" in out
    assert "custom_generate/generate.py:3: [process] call os.system()" in out
    assert "A recipe used by the tests." in out
    assert not marker.exists()


def test_demo_recipe_checks_and_stops_at_sentence_end(tiny_model, capsys):
    assert cli(["check", str(DEMO)]) == 0
    capsys.readouterr()
    ids = torch.tensor([[1, 17, 42, 7]])
    end_ids = list(range(60, 128))  # half the tiny vocabulary "ends a sentence"
    torch.manual_seed(0)
    out = genkit.generate(tiny_model, ids, custom_generate=str(DEMO), max_new_tokens=30, sentence_end_ids=end_ids,
                          max_sentences=2)
    new = out[0, 4:].tolist()
    hits = [i for i, t in enumerate(new) if t in end_ids]
    assert len(hits) == 2 and hits[-1] == len(new) - 1  # stopped right after the second sentence end
    with pytest.raises(ValueError, match="`max_sentences` must be a positive integer"):
        genkit.generate(tiny_model, ids, custom_generate=str(DEMO), max_sentences=0)


def test_local_recipe_forwarding_and_no_recursion(tmp_path, tiny_model):
    root = write_recipe(tmp_path / "fwd", {"custom_generate/generate.py": (
        "import genkit\n\nCALLS = []\n\n"
        "def generate(model, **kwargs):\n"
        "    CALLS.append(sorted(kwargs))\n"
        "    return ('wrapped', genkit.generate(model, **kwargs))\n")})
    streamer_calls = []

    class Streamer:
        def put(self, value):
            streamer_calls.append("put")

        def end(self):
            streamer_calls.append("end")

    ids = torch.tensor([[1, 17, 42, 7]])
    tag, seq = genkit.generate(tiny_model, input_ids=ids, custom_generate=str(root), streamer=Streamer(),
                               max_new_tokens=3, do_sample=False)
    assert tag == "wrapped" and torch.equal(seq, genkit.generate(tiny_model, ids, max_new_tokens=3))
    from genkit.recipes import load_recipe

    recipe = load_recipe(str(root))
    # no generation_config from the caller: the recipe gets the model's, resolved (docs/recipes.md)
    assert recipe.module.CALLS == [["do_sample", "generation_config", "input_ids", "max_new_tokens", "streamer"]]
    assert streamer_calls[-1] == "end" and "put" in streamer_calls


def test_recipe_commands_do_not_import_torch_until_run():
    code = ("import argparse, sys; import genkit.cli.recipe_cmds as m; p = argparse.ArgumentParser(); "
            "m.add_parser(p.add_subparsers()); p.parse_args(['inspect', 'org/x']); "
            "import genkit.recipes, genkit.recipes.inspection, genkit.recipes.publish, genkit.sandbox; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
