"""The hostile corpus (tests/recipes_corpus/): every broken or hostile recipe gives a clear error
naming the file (and line), and a marker that module-level code would write proves that no recipe
code ran where it must not. Entries that git cannot keep well (symlinks, binary, huge, unicode
names) are completed at test time."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from genkit.recipes import (
    RecipeImportError,
    RecipeValidationError,
    RequirementsError,
    RequirementsFormatError,
    load_recipe,
)

CORPUS = Path(__file__).parent / "recipes_corpus"
M = 3  # lines of marker code at the top of every corpus .py file

# case -> (exception, regex the message must match, may module-level code run?)
CASES: dict[str, tuple[type[Exception], str, bool]] = {
    "no_generate_file": (RecipeValidationError, r"custom_generate/generate.py: missing", False),
    "no_generate_function": (RecipeValidationError, r"generate.py: defines no top-level function `generate", False),
    "wrong_first_parameter": (RecipeValidationError,
                              (rf"generate.py:{M + 3}: the first parameter of generate\(\) must be `model`; "
                              r"found input_ids"), False),
    "no_positional_parameter": (RecipeValidationError, r"must be `model`; found nothing", False),
    "async_generate": (RecipeValidationError, rf"generate.py:{M + 3}: `generate` must be a plain function", False),
    "generate_is_lambda": (RecipeValidationError, r"must be defined with `def generate\(model", False),
    "syntax_error": (RecipeValidationError, r"custom_generate/generate.py:2: syntax error", False),
    "syntax_error_in_helper": (RecipeValidationError, r"custom_generate/utils.py:1: syntax error", False),
    "parent_import": (RecipeValidationError,
                      rf"generate.py:{M + 1}: `from \.\.evil import \.\.\.` leaves custom_generate/", False),
    "parent_import_from_subpackage": (RecipeValidationError,
                                      rf"pkg/mod.py:{M + 1}: `from \.\.\.outside import \.\.\.` leaves", False),
    "absolute_self_import": (RecipeValidationError,
                             rf"generate.py:{M + 1}: absolute import of the recipe's own module `utils`", False),
    "absolute_package_import": (RecipeValidationError,
                                (rf"generate.py:{M + 1}: absolute import of the recipe's own module "
                                r"`custom_generate.utils`"), False),
    "sibling_file_import": (RecipeValidationError, (rf"generate.py:{M + 1}: import of `helpers`, which lives next "
                                                   r"to custom_generate/"), False),
    "sibling_folder_import": (RecipeValidationError, rf"generate.py:{M + 1}: import of `shared.tools`", False),
    "missing_relative_module": (RecipeValidationError,
                                (rf"generate.py:{M + 1}: `from \.nothere import \.\.\.`: there is no "
                                r"custom_generate/nothere.py"), False),
    "circular_imports": (RecipeValidationError, (r"circular import between the recipe's modules: "
                                                r"custom_generate/generate.py:4 -> custom_generate/helper.py:4"), False),
    "circular_three_modules": (RecipeValidationError, r"circular import.*a.py:4 -> .*b.py:4 -> .*c.py:4", False),
    "raises_on_import": (RecipeImportError, (r"importing custom_generate/generate.py failed: RuntimeError: boom at "
                                            r"import"), True),
    "helper_raises_on_import": (RecipeImportError, r"failed: ValueError: helper exploded", True),
    "requirements_url": (RequirementsFormatError, r"requirements.txt:2: 'evilpkg @ https://.*URL requirements", False),
    "requirements_git": (RequirementsFormatError, r"requirements.txt:2: 'git\+https://.*URL requirements", False),
    "requirements_include": (RequirementsFormatError, (r"requirements.txt:1: '-r \.\./other-requirements.txt': "
                                                      r"pip options"), False),
    "requirements_index_url": (RequirementsFormatError, r"requirements.txt:1: '--index-url .*pip options", False),
    "requirements_malformed": (RequirementsFormatError, r"requirements.txt:1: 'torch>>=2': not a valid PEP 508",
                               False),
    "requirements_unmet": (RequirementsError, (r"not-a-real-package-xyz>=1.0 \(installed: None\)\n"
                                              r"torch>=999 \(installed: \d"), False),
    "bad_module_name": (RecipeValidationError, r"custom_generate/my-utils.py: 'my-utils.py' is not an importable",
                        False),
    "not_utf8": (RecipeValidationError, r"custom_generate/latin.py: not UTF-8 text", False),
    "no_custom_generate_folder": (RecipeValidationError, r"custom_generate: missing", False),
    "symlink_escape": (RecipeValidationError, r"custom_generate/utils.py: symlink leaves custom_generate/", False),
    "symlink_absolute": (RecipeValidationError, r"custom_generate/data.txt: symlink leaves custom_generate/", False),
    "symlink_folder": (RecipeValidationError, r"custom_generate/pkg: symlink leaves custom_generate/", False),
    "unicode_file_name": (RecipeValidationError, r"file name '\\xfctils.py' is not ASCII|'ütils.py' is not ASCII",
                          False),
    "traversal_file_name": (RecipeValidationError, (r"custom_generate/\.\.evil.py: file name '\.\.evil.py' is not "
                                                   r"allowed"), False),
    "binary_generate": (RecipeValidationError, r"custom_generate/generate.py: binary content \(NUL bytes\)", False),
    "huge_generate": (RecipeValidationError, r"custom_generate/generate.py: file is \d+ bytes, over the 1000000-byte",
                      False),
    "compiled_module": (RecipeValidationError, r"custom_generate/fast.so: compiled or native code is not allowed",
                        False),
}


def _complete(case: str, root: Path) -> None:
    """Test-time parts of the corpus."""
    cg = root / "custom_generate"
    if case == "symlink_escape":
        os.symlink("../outside.py", cg / "utils.py")
    elif case == "symlink_absolute":
        target = "/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd"
        os.symlink(target, cg / "data.txt")
    elif case == "symlink_folder":
        os.symlink("../elsewhere", cg / "pkg")
    elif case == "unicode_file_name":
        (cg / "ütils.py").write_text("X = 1\n")
    elif case == "traversal_file_name":
        (cg / "..evil.py").write_text("X = 1\n")
    elif case == "binary_generate":
        cg.mkdir(exist_ok=True)
        (cg / "generate.py").write_bytes(b"def generate(model):\n    return 1\n\x00\x01\x02binary\n")
    elif case == "huge_generate":
        cg.mkdir(exist_ok=True)
        (cg / "generate.py").write_text("def generate(model):\n    return 1\n" + "# pad\n" * 400_000)
    elif case == "compiled_module":
        (cg / "fast.so").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(200))


@pytest.fixture
def markers(tmp_path, monkeypatch):
    folder = tmp_path / "markers"
    folder.mkdir()
    monkeypatch.setenv("GENKIT_CORPUS_MARKERS", str(folder))
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path / "genkit_home"))
    monkeypatch.delenv("GENKIT_TRUST_LOCAL_RECIPES", raising=False)
    return folder


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(CORPUS / case, dst, symlinks=True)
    _complete(case, dst)
    return dst


def test_corpus_is_large_enough():
    hostile = [p.name for p in CORPUS.iterdir() if p.is_dir() and not p.name.startswith("ok_")]
    assert len(hostile) >= 25
    assert sorted(hostile) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_recipe_is_refused(case, tmp_path, markers):
    exc_type, pattern, may_run = CASES[case]
    root = _copy(case, tmp_path)
    path_before = list(sys.path)
    modules_before = set(sys.modules)
    with pytest.raises(exc_type) as err:
        load_recipe(str(root))
    assert re.search(pattern, str(err.value), re.DOTALL), str(err.value)
    ran = sorted(p.name for p in markers.iterdir())
    if may_run:
        assert ran, "the module-level code was expected to run (and fail)"
    else:
        assert ran == [], f"recipe code ran although the recipe was refused: {ran}"
    assert sys.path == path_before
    leaked = [m for m in set(sys.modules) - modules_before if m.startswith("_genkit_recipe_")]
    assert leaked == []  # a failed import leaves nothing behind


def test_good_recipe_with_every_allowed_import_form(tmp_path, markers):
    root = _copy("ok_relative_imports", tmp_path)
    path_before = list(sys.path)
    recipe = load_recipe(str(root))
    name, doubled, g, leaf, late, module = recipe.generate(None)
    assert (name, doubled, g, leaf, late) == ("ok_relative_imports", 4, 20, "leaf", "late")
    assert module.startswith("_genkit_recipe_") and module.endswith(".generate")
    assert sys.path == path_before
    assert "utils" not in sys.modules and "generate" not in sys.modules and "pkg" not in sys.modules
    assert {p.name for p in markers.iterdir()} >= {"ok_relative_imports__custom_generate_generate.py",
                                                   "ok_relative_imports__custom_generate_utils.py"}


def test_two_recipes_with_a_utils_module_never_collide(tmp_path, markers):
    a = load_recipe(str(_copy("ok_twin_a", tmp_path)))
    b = load_recipe(str(_copy("ok_twin_b", tmp_path)))
    assert a.generate(None) == "a" and b.generate(None) == "b"
    assert a.module.__name__ != b.module.__name__
    assert a.content_hash[:24] in a.module.__name__


def test_same_content_is_loaded_once(tmp_path, markers):
    first = load_recipe(str(_copy("ok_twin_a", tmp_path / "one")))
    for p in markers.iterdir():
        p.unlink()
    second = load_recipe(str(_copy("ok_twin_a", tmp_path / "two")))
    assert second.module is first.module  # cached by content hash
    assert list(markers.iterdir()) == []  # not executed again


def test_local_recipes_can_require_trust(tmp_path, markers, monkeypatch):
    from genkit.recipes import RecipeTrustError

    root = _copy("ok_twin_b", tmp_path)
    monkeypatch.setenv("GENKIT_TRUST_LOCAL_RECIPES", "0")
    with pytest.raises(RecipeTrustError, match="trust_remote_code=True"):
        load_recipe(str(root))
    assert list(markers.iterdir()) == []
    assert load_recipe(str(root), trust_remote_code=True).generate(None) == "b"
    monkeypatch.delenv("GENKIT_TRUST_LOCAL_RECIPES")
    home = Path(os.environ["GENKIT_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "settings.json").write_text('{"trust_local_recipes": false}')
    with pytest.raises(RecipeTrustError, match="settings.json"):
        load_recipe(str(root))
    with pytest.raises(RecipeTrustError, match="trust_remote_code=False forbids"):
        load_recipe(str(root), trust_remote_code=False)
