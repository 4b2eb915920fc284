"""The python examples of docs/api.md (GenerationConfig, processors, stopping criteria,
streamers, prompt-cache reuse) run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
SECTIONS = ("GenerationConfig", "Logits processors", "Guidance, watermark and compile configs", "Stopping criteria",
            "Streamers", "Reusing a prompt cache", "Scoring a prompt", "The one-import swap")


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


# -- an honest GenerationConfig (issue 10, item 7) --------------------------------------------------
def _fields_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text.split("### Fields", 1)[1].split("\n## ", 1)[0]


def _groups() -> tuple[set[str], set[str], set[str]]:
    section = _fields_section()
    implemented, rest = section.split("**Not supported yet.**", 1)
    unsupported, no_effect = rest.split("**Accepted with no effect", 1)
    names = lambda part: set(re.findall(r"^\| `([a-z_0-9]+)` \|", part, flags=re.MULTILINE))  # noqa: E731
    return names(implemented), names(unsupported), names(no_effect)


def test_every_field_is_documented_as_implemented_unsupported_or_without_effect():
    from genkit.config import NO_EFFECT, NOT_SUPPORTED, field_table

    implemented, unsupported, no_effect = _groups()
    assert unsupported == set(NOT_SUPPORTED) and no_effect == set(NO_EFFECT)
    assert not (implemented & unsupported) and not (implemented & no_effect)
    missing = set(field_table()) - implemented - unsupported - no_effect
    assert not missing, f"GenerationConfig fields documented nowhere in docs/api.md 'Fields': {sorted(missing)}"


UNSUPPORTED_VALUES = {
    "cache_config": {"backend": "quanto"},
    "use_mtp": True, "token_healing": True, "assistant_ensemble_weight": 0.5,
    "speculation_type": "tree",
}


def test_every_unsupported_field_has_a_test_value():
    from genkit.config import NOT_SUPPORTED

    assert set(UNSUPPORTED_VALUES) == set(NOT_SUPPORTED)


@pytest.mark.parametrize(("field", "value"), sorted(UNSUPPORTED_VALUES.items()))
def test_unsupported_fields_are_refused_not_ignored(field, value):
    import torch

    import genkit
    from genkit.errors import NotSupportedError
    from genkit.models.tiny import tiny_llama

    model = tiny_llama(seed=0)
    with pytest.raises(NotSupportedError, match=rf"not supported by genkit yet: `{field}`="):
        genkit.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, **{field: value})
    # a config (or generation_config.json) may hold it; generating with it is what is refused
    config = genkit.GenerationConfig(max_new_tokens=2, **{field: value})
    with pytest.raises(NotSupportedError):
        genkit.generate(model, torch.tensor([[1, 2, 3]]), generation_config=config)


def test_off_values_and_no_effect_fields_generate_as_without_them():
    import torch

    import genkit
    from genkit.models.tiny import tiny_llama

    model, ids = tiny_llama(seed=0), torch.tensor([[1, 2, 3]])
    plain = genkit.generate(model, ids, max_new_tokens=4)
    for extra in ({"guidance_scale": 1.0}, {"low_memory": False}, {"low_memory": None}, {"penalty_alpha": 0.0},
                  {"cache_implementation": "static"},
                  {"max_cache_len": 64}, {"disable_compile": True}, {"is_assistant": True}):
        assert torch.equal(genkit.generate(model, ids, max_new_tokens=4, **extra), plain), extra
