"""docs/hooks.md must document every hookspec (a section whose heading is the hook's signature)
with a runnable example; the examples are run. docs/packs.md excerpts must match the pack files
they quote."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

from genkit import hookspecs

REPO = Path(__file__).resolve().parents[1]
HOOKS_MD = REPO / "docs" / "hooks.md"
PACKS_MD = REPO / "docs" / "packs.md"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def hookspec_signatures() -> dict[str, str]:
    """``name -> "name(arg, ...)"`` for every function marked as a genkit hookspec."""
    out = {}
    for name, fn in vars(hookspecs).items():
        if inspect.isfunction(fn) and hasattr(fn, "genkit_spec"):
            params = ", ".join(inspect.signature(fn).parameters)
            out[name] = f"{name}({params})"
    return out


def sections(text: str) -> dict[str, str]:
    """``## heading`` -> body."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_there_are_hookspecs_to_document():
    assert set(hookspec_signatures()) == {"register_strategies", "register_logits_processors",
                                          "register_candidate_generators", "register_streamers",
                                          "register_watermarks", "register_schedulers"}


def test_every_hookspec_has_a_section_with_an_example():
    docs = sections(HOOKS_MD.read_text(encoding="utf-8"))
    missing = [sig for sig in hookspec_signatures().values() if sig not in docs]
    assert not missing, f"docs/hooks.md has no section for: {missing}"
    for sig in hookspec_signatures().values():
        blocks = [code for lang, code in FENCE.findall(docs[sig]) if lang == "python"]
        assert blocks, f"the section `## {sig}` in docs/hooks.md has no python example"
    stale = [h for h in docs if re.match(r"\w+\(", h) and h not in hookspec_signatures().values()]
    assert not stale, f"docs/hooks.md documents hooks that do not exist: {stale}"


def test_coverage_check_catches_an_undocumented_hook():
    """The check above compares against the live hookspecs module, so a new hook needs a section."""
    fake = {**hookspec_signatures(), "register_tokenizers": "register_tokenizers(register)"}
    docs = sections(HOOKS_MD.read_text(encoding="utf-8"))
    assert [s for s in fake.values() if s not in docs] == ["register_tokenizers(register)"]


RUNNER = r'''
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
failures = []
for heading, code in blocks:
    try:
        exec(compile(code, f"docs/hooks.md [{heading}]", "exec"), {"__name__": "__docs__"})
    except Exception:
        failures.append([heading, traceback.format_exc()])
print("@@" + json.dumps(failures))
'''


def test_examples_run():
    docs = sections(HOOKS_MD.read_text(encoding="utf-8"))
    blocks = [[heading, code] for heading, body in docs.items()
              for lang, code in FENCE.findall(body) if lang == "python"]
    assert len(blocks) >= 4
    proc = subprocess.run([sys.executable, "-c", RUNNER], check=False, input=json.dumps(blocks), capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), env={**_clean_env(), "GENKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("@@"))
    failures = json.loads(line[2:])
    assert not failures, "\n\n".join(f"## {h}\n{tb}" for h, tb in failures)


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("GENKIT_")}


def test_packs_tutorial_excerpts_match_the_pack():
    """Blocks in docs/packs.md that start with ``# file: <path>`` quote that file verbatim."""
    text = PACKS_MD.read_text(encoding="utf-8")
    quoted = 0
    for _lang, code in FENCE.findall(text):
        first, _, rest = code.partition("\n")
        m = re.match(r"#\s*file:\s*(\S+)", first.strip())
        if not m:
            continue
        source = (REPO / m.group(1)).read_text(encoding="utf-8")
        for chunk in rest.split("\n# ...\n"):
            assert chunk.strip() in source, f"docs/packs.md quotes {m.group(1)} but this is not in it:\n{chunk}"
        quoted += 1
    assert quoted >= 3
