"""The python examples of docs/api.md (GenerationConfig, processors, stopping criteria,
streamers, prompt-cache reuse) run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
SECTIONS = ("GenerationConfig", "Logits processors", "Stopping criteria", "Streamers", "Reusing a prompt cache")


def _blocks() -> list[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    out = []
    for part in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title = part.splitlines()[0].strip()
        if title in SECTIONS:
            for code in re.findall(r"```python\n(.*?)```", part, flags=re.DOTALL):
                out.append((title, code))
    return out


def test_every_section_has_an_example():
    assert {title for title, _ in _blocks()} == set(SECTIONS)


@pytest.mark.parametrize(("title", "code"), _blocks(), ids=[t for t, _ in _blocks()])
def test_doc_example_runs(title, code, capsys):
    exec(compile(code, f"docs/api.md:{title}", "exec"), {"__name__": "__doc_example__"})  # noqa: S102 -- our own docs
    assert capsys.readouterr().out.strip() != "" or title == "Streamers"
