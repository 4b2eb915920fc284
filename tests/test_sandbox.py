"""sandbox/: scanning, import rules, audit and the private importer, on small trees built here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hub_server import write_recipe

import genkit.sandbox as sandbox
from genkit.sandbox import SandboxError, audit_sources, check_source, import_tree, scan_tree


def _tree(tmp_path: Path, files: dict[str, str | bytes], **kw):
    write_recipe(tmp_path, files, readme="")
    return scan_tree(tmp_path, **kw)


def test_scan_reads_files_hashes_content_and_skips_pycache(tmp_path):
    tree = _tree(tmp_path, {"custom_generate/generate.py": "def generate(model):\n    pass\n",
                            "custom_generate/__pycache__/generate.cpython-311.pyc": b"\x00junk",
                            "custom_generate/data/table.json": "{}", "notes.txt": "x",
                            "custom_generate/.DS_Store": b"\x00\x01", "custom_generate/.cache/x.bin": b"\x00"})
    assert sorted(tree.files) == ["data/table.json", "generate.py"]
    assert tree.outside_names == frozenset({"notes.txt"})
    again = scan_tree(tmp_path)
    assert again.content_hash == tree.content_hash
    (tmp_path / "custom_generate" / "data" / "table.json").write_text("{ }")
    assert scan_tree(tmp_path).content_hash != tree.content_hash


def test_scan_collects_every_problem_at_once(tmp_path):
    with pytest.raises(SandboxError) as err:
        _tree(tmp_path, {"custom_generate/generate.py": "x = 1\n", "custom_generate/bad name.py": "",
                         "custom_generate/lib.pyc": b"\x00", "custom_generate/2fast.py": "X = 1\n"})
    text = str(err.value)
    assert "bad name.py" in text and "lib.pyc" in text and "'2fast.py' is not an importable module name" in text
    assert len(err.value.problems) == 3


def test_symlinks_inside_the_folder_or_allowed_roots_are_fine(tmp_path):
    write_recipe(tmp_path, {"custom_generate/generate.py": "def generate(model):\n    pass\n",
                            "custom_generate/real.py": "X = 1\n", "blobs/abc": "Y = 2\n"}, readme="")
    os.symlink("real.py", tmp_path / "custom_generate" / "alias.py")
    os.symlink("../blobs/abc", tmp_path / "custom_generate" / "blob.py")
    with pytest.raises(SandboxError, match="blob.py: symlink leaves custom_generate/"):
        scan_tree(tmp_path)
    tree = scan_tree(tmp_path, link_roots=(tmp_path / "blobs",))
    assert tree.files["alias.py"] == b"X = 1\n" and tree.files["blob.py"] == b"Y = 2\n"


@pytest.mark.parametrize(("path", "ok"), [
    ("custom_generate/generate.py", True), ("custom_generate/pkg/mod.py", True),
    ("custom_generate/../x.py", False), ("/etc/passwd", False), ("custom_generate//x.py", False),
    ("custom_generate/x\\y.py", False), ("custom_generate/é.py", False), ("custom_generate/./x.py", False),
])
def test_check_relpath(path, ok):
    assert (sandbox.check_relpath(path) is None) is ok


def test_import_rules_allow_the_documented_forms(tmp_path):
    tree = _tree(tmp_path, {
        "custom_generate/generate.py": "import os\nimport torch.nn as nn\nfrom . import utils\nfrom .utils import f\n"
                                       "from .pkg.mod import g\n\ndef generate(model):\n    from .pkg import mod\n",
        "custom_generate/utils.py": "def f():\n    pass\n",
        "custom_generate/pkg/mod.py": "from ..utils import f\n\ndef g():\n    pass\n"})
    _, problems = check_source(tree)
    assert problems == []


def test_function_level_cycles_are_allowed_module_level_are_not(tmp_path):
    tree = _tree(tmp_path, {"custom_generate/generate.py": "from .a import A\n\ndef generate(model):\n    pass\n",
                            "custom_generate/a.py": "A = 1\n\ndef later():\n    from .generate import generate\n"})
    assert check_source(tree)[1] == []
    (tmp_path / "custom_generate" / "a.py").write_text("from .generate import generate\nA = 1\n")
    problems = check_source(scan_tree(tmp_path))[1]
    assert [str(p) for p in problems] == [
        ("custom_generate/a.py:1: circular import between the recipe's modules: custom_generate/a.py:1 -> "
        "custom_generate/generate.py:1")]


def test_audit_finds_risky_calls_through_aliases():
    src = ("import os as o\nimport subprocess as sp\nfrom pickle import loads\nimport torch\nimport socket\n"
           "o.system('ls')\nsp.run(['ls'])\nloads(b'')\nexec('1')\n__import__('x')\n"
           "torch.load('w.pt')\ntorch.load('w.pt', weights_only=True)\nopen('f', 'w')\nopen('f')\n"
           "socket.socket()\nimport importlib\nimportlib.import_module('x')\n")
    found = [str(f) for f in audit_sources({"g.py": src})]
    assert found == [
        "g.py:2: [process] import subprocess",
        "g.py:3: [deserialization] from pickle import loads",
        "g.py:5: [network] import socket",
        "g.py:6: [process] call os.system()",
        "g.py:7: [process] call subprocess.run()",
        "g.py:8: [deserialization] call pickle.loads()",
        "g.py:9: [dynamic code] call exec()",
        "g.py:10: [dynamic code] call __import__()",
        "g.py:11: [deserialization] call torch.load()",
        "g.py:13: [filesystem] open(..., 'w')",
        "g.py:15: [network] call socket.socket()",
        "g.py:16: [dynamic code] import importlib",
        "g.py:17: [dynamic code] call importlib.import_module()",
    ]


def test_import_tree_uses_a_private_name_and_leaves_sys_path(tmp_path):
    tree = _tree(tmp_path, {"custom_generate/generate.py": "from .utils import V\n\ndef generate(model):\n"
                                                           "    return V, __name__, __package__\n",
                            "custom_generate/utils.py": "V = 'value'\n"})
    path_before, meta_before = list(sys.path), len(sys.meta_path)
    module = import_tree(tree)
    value, name, package = module.generate(None)
    assert value == "value"
    assert name == sandbox.module_name(tree) + ".generate" and package == sandbox.module_name(tree)
    assert name.startswith("_genkit_recipe_") and tree.content_hash[:24] in name
    assert sys.path == path_before and len(sys.meta_path) <= meta_before + 1
    assert "utils" not in sys.modules and "generate" not in sys.modules
    assert module.__file__ == str(tmp_path / "custom_generate" / "generate.py")
    assert import_tree(tree) is module
    # the finder answers only for its own prefix: an unknown private name is not importable
    with pytest.raises(ModuleNotFoundError):
        __import__(sandbox.PREFIX + "0" * 24)


def test_failed_import_purges_modules_and_can_be_retried(tmp_path):
    tree = _tree(tmp_path, {"custom_generate/generate.py": "from .utils import V\nraise KeyError('nope')\n",
                            "custom_generate/utils.py": "V = 1\n"})
    with pytest.raises(sandbox.RecipeImportError, match="KeyError: 'nope'"):
        import_tree(tree, label="test recipe")
    name = sandbox.module_name(tree)
    assert not [m for m in sys.modules if m.startswith(name)]
    with pytest.raises(sandbox.RecipeImportError):
        import_tree(tree)
