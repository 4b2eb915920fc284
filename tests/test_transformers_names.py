"""Every public logits processor and stopping criterion of transformers 5's ``generation`` package
that is not model-specific is exported by ``genkit`` under the same name, with the same constructor
parameters (issue 18, item 6); ``GenerationMode`` and ``set_seed`` too."""

from __future__ import annotations

import inspect

import pytest

import genkit

generation = pytest.importorskip("transformers.generation")

# for one model family only
MODEL_SPECIFIC = {
    "AlternatingCodebooksLogitsProcessor": "Bark's two codebooks",
    "WhisperTimeStampLogitsProcessor": "Whisper's timestamp tokens",
}
# shipped by a pack in plugins/ rather than by genkit itself
PENDING = {
    "SynthIDTextWatermarkLogitsProcessor": "plugins/genkit-synthid-pack (tests/test_synthid_pack.py)",
}
# transformers' parameters, then genkit's own keyword parameters (with defaults)
EXTENDED = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": ["max_length"],
}
NAMES = generation._import_structure["logits_process"] + generation._import_structure["stopping_criteria"]


def _params(obj) -> list[str]:
    return list(inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in MODEL_SPECIFIC and n not in PENDING])
def test_exported_under_transformers_name_with_its_parameters(name):
    ours = getattr(genkit, name)
    assert name in genkit.__all__
    assert _params(ours) == _params(getattr(generation, name)) + EXTENDED.get(name, [])


def test_every_other_name_is_accounted_for():
    assert set(MODEL_SPECIFIC) | set(PENDING) <= set(NAMES)
    assert len([n for n in NAMES if n not in MODEL_SPECIFIC and n not in PENDING]) >= 30


def test_generation_mode_and_set_seed_are_exported():
    from transformers.generation import GenerationMode

    assert {m.value for m in genkit.GenerationMode} == {m.value for m in GenerationMode}
    assert genkit.GenerationMode.GREEDY_SEARCH == GenerationMode.GREEDY_SEARCH
    assert "GenerationMode" in genkit.__all__ and "set_seed" in genkit.__all__
    assert _params(genkit.set_seed) == _params(pytest.importorskip("transformers").set_seed)
