# ruff: noqa: F811 - the hub_server fixture is imported, then requested by name
"""The documentation of the pages that have no docs test of their own runs as written.

- Every ```python block of these pages runs, each page in a fresh interpreter (``PYTHONPATH`` the
  checkout and tests/, ``OMP_NUM_THREADS=1``), its blocks in order in one namespace (a page's later
  examples continue its earlier ones); a block that raises fails the test with its traceback.
- A page that loads the demo model or the Hub gets, through ``SUBSTITUTIONS``, a tiny stand-in
  written in place of a quoted name before the page runs -- the only change made to the text, and
  each one must still occur in its page. Pages whose examples other tests run are listed in
  ``RUN_ELSEWHERE``; every docs page with a python block is in one of the two.
- Every ``genkit COMMAND --option`` shown in a code block or inline code names a sub-command and
  options that exist; docs/serve.md's option table lists exactly the options of ``genkit serve``,
  and its ``curl`` bodies are accepted by a running server.
- docs/api.md's "Public names" lists ``genkit.__all__``, each with the signature it has.
"""

from __future__ import annotations

import enum
import inspect
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import write_tiny_model
from hub_server import hub_server  # noqa: F401 - the fixture, requested by name

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)

# page -> {quoted text in the page: what stands for it}. Placeholders: TINY (a tiny random Llama
# folder with a BPE tokenizer and a chat template, conftest.write_tiny_model), TINY_GGUF (a tiny
# random Q4_1 GGUF, test_quantized.write_quantized_gguf), DEMO_RECIPE, and the per-test ones below.
SUBSTITUTIONS: dict[str, dict[str, str]] = {
    "README.md": {'"path/or/org/model"': "TINY", '"org/recipe"': "DEMO_RECIPE"},  # a placeholder Hub id
    "docs/batch.md": {},
    "docs/beam.md": {},
    "docs/threads.md": {},
    "docs/models.md": {'"smollm2"': "TINY", '"SmolLM2-135M-Instruct.Q4_1.gguf"': "TINY_GGUF"},
    # a recipe published to tests/hub_server.py as org/recipe (tag v1.2), and a copy of it on disk
    "docs/recipes.md": {'"smollm2"': "TINY", "3f2a…40 hex": "COMMIT", '"path/to/my-recipe"': "RECIPE_FOLDER"},
    # a `genkit serve` of TINY as "smollm2"
    "docs/serve.md": {"http://127.0.0.1:8000": "BASE_URL"},
}
RUN_ELSEWHERE = {
    "docs/api.md": "tests/test_config_docs.py", "docs/continuous_batching.md": "tests/test_docs_strategies.py",
    "docs/strategies.md": "tests/test_docs_strategies.py", "docs/hooks.md": "tests/test_docs_hooks.py",
    "docs/structured_outputs.md": "tests/test_docs_structured.py",
    "docs/encoder_decoder.md": "tests/test_docs_encoder_decoder.py",
    # the `# file:` excerpts are compared with the pack files (test_docs_hooks.py) and section 10 runs
    # with the pack installed (test_synthid_pack.py); section 7's two usage blocks need the sampling
    # and events packs installed, which no test here does (checked by hand)
    "docs/packs.md": "tests/test_docs_hooks.py, tests/test_synthid_pack.py",
}
DOCUMENTATION = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]

RUNNER = r'''
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__doc_example__"}
for where, code in blocks:
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        print("@@" + json.dumps([where, traceback.format_exc()]))
        break
'''


def python_blocks(page: str) -> list[tuple[str, str]]:
    """``(page:line, code)`` of every ```python block of ``page``."""
    text = (REPO / page).read_text(encoding="utf-8")
    return [(f"{page}:{text.count(chr(10), 0, m.start()) + 1}", m.group(2))
            for m in FENCE.finditer(text) if m.group(1) == "python"]


def run_page(page: str, values: dict[str, str]) -> str:
    """Run ``page``'s python blocks with its substitutions (``values`` of the placeholders);
    returns what they printed."""
    blocks = []
    for where, code in python_blocks(page):
        for quoted, name in SUBSTITUTIONS[page].items():
            code = code.replace(quoted, repr(values[name]) if quoted.startswith('"') else values[name])
        blocks.append([where, code])
    text = (REPO / page).read_text(encoding="utf-8")
    stale = [quoted for quoted in SUBSTITUTIONS[page] if quoted not in text]
    assert not stale, f"{page} no longer holds {stale}: update SUBSTITUTIONS"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                          timeout=300, cwd=str(REPO), env=env, check=False)
    failed = [json.loads(line[2:]) for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert not failed, f"the example at {failed[0][0]} raised:\n{failed[0][1]}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def values(tmp_path_factory) -> dict[str, str]:
    folder = write_tiny_model(tmp_path_factory.mktemp("docs") / "tiny")
    return {"TINY": str(folder), "DEMO_RECIPE": str(REPO / "docs" / "examples" / "demo_recipe")}


def test_every_page_with_python_examples_is_run():
    pages = {page for page in DOCUMENTATION if python_blocks(page)}
    assert pages <= set(SUBSTITUTIONS) | set(RUN_ELSEWHERE), sorted(pages - set(SUBSTITUTIONS) - set(RUN_ELSEWHERE))
    assert not set(SUBSTITUTIONS) & set(RUN_ELSEWHERE)


@pytest.mark.parametrize("page", ["README.md", "docs/batch.md", "docs/beam.md", "docs/threads.md"])
def test_page_runs(page, values):
    assert python_blocks(page)
    run_page(page, values)


def test_models_page_runs(values, tmp_path):
    pytest.importorskip("gguf")
    from test_quantized import write_quantized_gguf

    write_quantized_gguf(tmp_path / "q4_1.gguf", "Q4_1")
    printed = run_page("docs/models.md", {**values, "TINY_GGUF": str(tmp_path / "q4_1.gguf")})
    assert "torch.Size([1, 11])" in printed  # the kernel-choice example's comment


RECIPE = "import genkit\n\n\ndef generate(model, inputs=None, my_arg=None, **kwargs):\n" \
         "    assert my_arg in (None, 3)\n    return genkit.generate(model, inputs, **kwargs)\n"


def test_recipes_page_runs(values, hub_server, tmp_path):
    from hub_server import write_recipe

    from genkit.cli import main

    folder = write_recipe(tmp_path / "recipe", {"custom_generate/generate.py": RECIPE})
    assert main(["publish", str(folder), "org/recipe", "--no-smoke"]) == 0
    commit = hub_server.state.repo("org/recipe").branches["main"]
    hub_server.state.tag("org/recipe", "v1.2", commit)
    run_page("docs/recipes.md", {**values, "COMMIT": commit, "RECIPE_FOLDER": str(folder)})


def test_serve_page_runs_and_its_curl_bodies_are_accepted(values):
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from test_serve import launch

    proc, base = launch(values["TINY"], "--served-model-name", "smollm2")
    try:
        run_page("docs/serve.md", {**values, "BASE_URL": base})
        curls = re.findall(r"curl -s http://127\.0\.0\.1:8000(\S+) .*?-d '(\{.*?\})'",
                           (REPO / "docs" / "serve.md").read_text(encoding="utf-8"), flags=re.DOTALL)
        assert curls
        for path, body in curls:
            request = urllib.request.Request(base + path, data=body.encode(), headers={
                "Content-Type": "application/json", "Authorization": "Bearer KEY"})
            with urllib.request.urlopen(request, timeout=120) as answer:  # noqa: S310 - 127.0.0.1
                assert answer.status == 200 and json.loads(answer.read())["choices"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- the command lines shown --------------------------------------------------------------------
def _command_lines(text: str) -> list[str]:
    """Each ``genkit ...`` command of the code blocks (continuation lines joined, comments
    dropped) and of the inline code spans that show an option."""
    lines = []
    for lang, code in FENCE.findall(text):
        if lang not in ("", "bash", "console", "sh", "shell"):
            continue
        code = re.sub(r"\\\n\s*", " ", code)  # backslash continuations
        code = re.sub(r"\n[ \t]+(?=\[)", " ", code)  # an indented synopsis line continues the one above
        lines += [re.sub(r"\s#\s.*$", "", line).rstrip() for line in code.splitlines()]
    prose = FENCE.sub("", text)
    lines += re.findall(r"`([^`\n]*\bgenkit [a-z][^`\n]* --[^`\n]*)`", prose)  # with an option (not `genkit gemv`)
    return [line for line in lines if re.search(r"(?:^|[$|]\s*)genkit [a-z]", line.strip())]


def _subcommands() -> dict[str, set[str]]:
    from genkit.cli import build_parser

    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001 - argparse's API
    return {name: {o for a in sub._actions for o in a.option_strings} for name, sub in choices.items()}  # noqa: SLF001


def test_every_genkit_command_shown_exists():
    commands, wrong = _subcommands(), []
    for page in DOCUMENTATION:
        for line in _command_lines((REPO / page).read_text(encoding="utf-8")):
            for match in re.finditer(r"(?:^|[$|]\s*)genkit ([a-z][a-z-]*)(.*?)(?=\|\s*[a-z]|$)", line.strip()):
                name, rest = match.groups()
                if name not in commands:
                    wrong.append(f"{page}: `genkit {name}` is no command ({line.strip()})")
                    continue
                for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                    if option not in commands[name]:
                        wrong.append(f"{page}: `genkit {name}` has no {option} ({line.strip()})")
    assert not wrong, "\n".join(wrong)


def test_the_command_check_sees_a_wrong_option():
    assert _command_lines("```bash\n$ genkit serve smollm2 --porrt 80  # a comment --x\n```\n") == [
        "$ genkit serve smollm2 --porrt 80"]
    assert "--porrt" not in _subcommands()["serve"]


def test_serve_options_table_lists_every_option():
    section = (REPO / "docs" / "serve.md").read_text(encoding="utf-8").split("\n## Options\n", 1)[1].split("\n## ")[0]
    documented = {o for row in re.findall(r"^\| ([^|]*) \|", section, flags=re.MULTILINE)
                  for o in re.findall(r"`(--?[a-z][a-z0-9-]*)", row)}
    assert documented == _subcommands()["serve"] - {"-h", "--help"}


# -- docs/api.md's public names -----------------------------------------------------------------
def shown_signature(obj: object) -> str:
    """``(a, b=1, *, c=None, **kw)`` for a function or a class (its constructor); ``""`` for a
    class whose constructor takes no argument, an enum or another object."""
    if not (inspect.isfunction(obj) or isinstance(obj, type)) or (isinstance(obj, type) and issubclass(obj, enum.Enum)):
        return ""
    parts, starred = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL or p.kind is p.VAR_KEYWORD:
            starred = starred or p.kind is p.VAR_POSITIONAL
            parts.append(("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name)
            continue
        if p.kind is p.KEYWORD_ONLY and not starred:
            parts.append("*")
            starred = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"({', '.join(parts)})" if parts else ""


def test_api_md_lists_every_public_name_with_its_signature():
    import genkit

    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)(\(.*?\))?` \|", section, flags=re.MULTILINE))
    assert sorted(rows) == sorted(genkit.__all__)
    wrong = {name: (shown, shown_signature(getattr(genkit, name))) for name, shown in rows.items()
             if shown != shown_signature(getattr(genkit, name))}
    assert not wrong, "docs/api.md, Public names: {name: (documented, actual)}: " + repr(wrong)
