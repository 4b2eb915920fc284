"""docs/strategies.md: every python example runs, in order, in one namespace, on the demo model
(the examples assert their own claims: low_memory gives the same tokens, early exit and universal
assisted decoding give greedy's tokens)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "strategies.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_every_strategy_section_has_an_example_and_they_run(capsys):
    text = DOC.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    for section in sections:
        assert any(lang == "python" for lang, _ in FENCE.findall(section)), section.splitlines()[0]
    namespace: dict = {}
    for lang, code in FENCE.findall(text):
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own docs
    out = capsys.readouterr().out
    assert out.count("The capital of France is") >= 3  # the examples print what they generate
    marked_z = namespace["result"].z_score
    assert float(marked_z[0]) > 4
    assert float(namespace["detector"](namespace["plain"], return_dict=True).z_score[0]) < 4
    assert namespace["counts"]["full_passes"] <= 20


def test_the_continuous_batching_examples_run(capsys):
    doc = DOC.parent / "continuous_batching.md"
    namespace: dict = {}
    for lang, code in FENCE.findall(doc.read_text(encoding="utf-8")):
        if lang == "python":
            exec(compile(code, str(doc), "exec"), namespace)  # noqa: S102 - our own docs
    results = namespace["results"]
    assert list(results) == ["req_0", "req_1", "req_2"]
    assert all(o.status.name == "FINISHED" for o in results.values())
    assert "req_0 FINISHED" in capsys.readouterr().out
