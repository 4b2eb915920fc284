"""requirements.txt checking with packaging (PEP 508)."""

from __future__ import annotations

from importlib import metadata

import pytest

from genkit.recipes.errors import RequirementsError, RequirementsFormatError
from genkit.recipes.requirements import check_requirements, ensure_requirements, parse_requirements

TORCH = metadata.version("torch")
PACKAGING = metadata.version("packaging")


def test_specifier_sets_markers_extras_and_comments():
    text = ("# header comment\n\ntorch>=2.0,<100  # inline\npackaging!=0.1\n"
            "huggingface_hub[torch]>=0.30\nnot-here>=1 ; python_version < '3'\n")
    statuses = check_requirements(text)
    assert [s.line.number for s in statuses] == [3, 4, 5, 6]
    assert all(s.ok for s in statuses)
    assert statuses[-1].skipped and statuses[-1].installed is None
    assert str(statuses[0]) == f"torch<100,>=2.0 (installed: {TORCH})"


def test_all_unmet_lines_in_one_import_error():
    with pytest.raises(RequirementsError) as err:
        ensure_requirements("torch>=999\nnot-a-real-package-xyz>=1.0\npackaging>=1\nhuggingface_hub[oauth]>=0.1\n",
                            "recipe X")
    text = str(err.value)
    assert isinstance(err.value, ImportError)
    assert f"torch>=999 (installed: {TORCH})" in text
    assert "not-a-real-package-xyz>=1.0 (installed: None)" in text
    assert "huggingface_hub[oauth]>=0.1" in text and "authlib>=1.8.0 for extra [oauth]" in text
    assert "packaging" not in text.split("install them")[0]
    # as transformers' docs show it: the first line, then one line per unmet requirement
    lines = text.splitlines()
    assert lines[0] == "Missing requirements in your local environment for `recipe X`:"
    assert lines[1] == f"torch>=999 (installed: {TORCH})"
    assert lines[2] == "not-a-real-package-xyz>=1.0 (installed: None)"
    # the install hint is shell-quoted (a specifier like >=999 would redirect output unquoted)
    assert lines[-1].endswith("install them with: pip install 'torch>=999' 'not-a-real-package-xyz>=1.0' "
                              "'huggingface-hub[oauth]>=0.1')")


def test_requirements_error_reads_as_transformers_docs():
    with pytest.raises(ImportError) as err:
        ensure_requirements("foo\nbar==0.0.0\ntorch>=99.0\n", "Hub recipe org/repo@abc", name="org/repo")
    assert str(err.value).splitlines()[:4] == [
        "Missing requirements in your local environment for `org/repo`:",
        "foo (installed: None)", "bar==0.0.0 (installed: None)", f"torch>=99.0 (installed: {TORCH})"]


@pytest.mark.parametrize(("line", "why"), [
    ("-r other.txt", "pip options"), ("--index-url https://x/simple", "pip options"), ("-e .", "pip options"),
    ("pkg @ https://example.com/p.whl", "URL requirements"), ("git+https://github.com/a/b", "URL requirements"),
    ("file:///tmp/x", "URL requirements"), ("torch>>=2", "not a valid PEP 508"), ("torch[", "not a valid PEP 508"),
])
def test_bad_lines_are_named(line, why):
    with pytest.raises(RequirementsFormatError) as err:
        parse_requirements(f"torch\n{line}\n", label="my recipe")
    assert f"custom_generate/requirements.txt:2: {line!r}: " in str(err.value) and why in str(err.value)
    assert str(err.value).startswith("my recipe:")


def test_prereleases_count_as_installed_versions():
    assert check_requirements(f"packaging=={PACKAGING}\n")[0].ok


def test_more_than_the_limit_of_requirement_lines_is_refused_before_any_look_up(tmp_path):
    from genkit.recipes import load_recipe
    from genkit.recipes.inspection import inspect_recipe
    from genkit.recipes.requirements import MAX_REQUIREMENTS

    assert MAX_REQUIREMENTS == 256
    lines = ["# one comment per line does not count", ""] * 300 + ["torch>=1"] * 256
    assert all(s.ok for s in check_requirements("\n".join(lines)))
    text = "\n".join([*lines, "numpy>=1"])
    with pytest.raises(RequirementsFormatError, match="custom_generate/requirements.txt:857: more than 256 "
                                                      "requirement lines"):
        check_requirements(text)
    root = tmp_path / "many"
    (root / "custom_generate").mkdir(parents=True)
    (root / "custom_generate" / "generate.py").write_text("def generate(model, **kw):\n    return 1\n")
    (root / "custom_generate" / "requirements.txt").write_text(text)
    with pytest.raises(RequirementsFormatError, match="more than 256 requirement lines"):
        load_recipe(str(root))
    assert any("more than 256 requirement lines" in p for p in inspect_recipe(str(root)).problems)
