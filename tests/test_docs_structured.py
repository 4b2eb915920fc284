"""The python examples of docs/structured_outputs.md run as written: the library ones in this
process (the demo model from the tests' cache), the ones that use the openai client against a
``genkit serve`` of the demo model on 127.0.0.1 (``OPENAI_BASE_URL``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("gguf")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_helpers import ROOT, demo_folder, running_server  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "structured_outputs.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
LIBRARY = [b for b in BLOCKS if "openai" not in b]
SERVE = [b for b in BLOCKS if "openai" in b]


@pytest.fixture(scope="module")
def home():
    demo_folder()  # the demo model, converted once into the tests' cache
    return str(ROOT / "home")


def test_the_page_has_library_and_serve_examples():
    assert len(LIBRARY) >= 2 and len(SERVE) >= 2


@pytest.mark.parametrize("code", LIBRARY, ids=[f"library{i}" for i in range(len(LIBRARY))])
def test_library_example_runs(code, home, monkeypatch, capsys):
    monkeypatch.setenv("GENKIT_HOME", home)
    exec(compile(code, "docs/structured_outputs.md", "exec"), {"__name__": "__doc_example__"})  # noqa: S102
    assert capsys.readouterr().out.strip()


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    with running_server(demo_folder()) as base:
        yield base


@pytest.mark.parametrize("code", SERVE, ids=[f"serve{i}" for i in range(len(SERVE))])
def test_serve_example_runs(code, server, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_BASE_URL", server + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    exec(compile(code, "docs/structured_outputs.md", "exec"), {"__name__": "__doc_example__"})  # noqa: S102
    assert capsys.readouterr().out.strip()
