"""transformers 5's remaining public, model-independent generation classes, exported by genkit
under the same names (issue 18, item 6): ``ClassifierFreeGuidanceLogitsProcessor`` (the batched
variant), ``BaseWatermarkingConfig`` and ``CompileConfig``; and an account of the names genkit
still lacks."""

from __future__ import annotations

import json

import pytest
import torch

import genkit
from genkit.errors import ConfigError
from genkit.models.tiny import tiny_llama

transformers = pytest.importorskip("transformers")
import transformers.generation as generation  # noqa: E402 (after the importorskip)

# transformers.generation's public classes that genkit does not export, and why
NOT_EXPORTED = {
    # model-specific
    "AlternatingCodebooksLogitsProcessor": "Bark's two codebooks",
    "WhisperTimeStampLogitsProcessor": "Whisper's timestamp tokens",
    "GenerateEncoderDecoderOutput": "encoder-decoder models; genkit's models are decoder-only",
    "GenerateBeamEncoderDecoderOutput": "encoder-decoder models; genkit's models are decoder-only",
    "TextDiffusionStreamer": "diffusion language models",
    # the SynthID watermark ships as a pack (plugins/genkit-synthid-pack), under these names
    "SynthIDTextWatermarkingConfig": "genkit_synthid_pack",
    "SynthIDTextWatermarkLogitsProcessor": "genkit_synthid_pack",
    "SynthIDTextWatermarkDetector": "genkit_synthid_pack",
    "BayesianDetectorConfig": "genkit_synthid_pack",
    "BayesianDetectorModel": "genkit_synthid_pack",
    # continuous batching: another issue
    "ContinuousBatchingConfig": "continuous batching",
    "ContinuousBatchingManager": "continuous batching",
    "ContinuousMixin": "continuous batching",
    "Scheduler": "continuous batching",
    "FIFOScheduler": "continuous batching",
    "PrefillFirstScheduler": "continuous batching",
    # candidate generators are registered plugins in genkit (register_candidate_generators), not classes
    "CandidateGenerator": "genkit.protocols (a Protocol) and the register_candidate_generators hook",
    "AssistedCandidateGenerator": "the draft_model candidate generator",
    "PromptLookupCandidateGenerator": "the prompt_lookup candidate generator",
    "EarlyExitCandidateGenerator": "the early-exit strategy",
    "DFlashTokenCandidateGenerator": "model-specific (DFlash draft heads)",
}


def test_every_missing_name_is_accounted_for():
    missing = {n for n in dir(generation) if not n.startswith("_") and n[0].isupper() and not hasattr(genkit, n)}
    assert missing <= set(NOT_EXPORTED), sorted(missing - set(NOT_EXPORTED))
    for name in ("ClassifierFreeGuidanceLogitsProcessor", "BaseWatermarkingConfig", "CompileConfig"):
        assert name in genkit.__all__ and hasattr(genkit, name)


# -- ClassifierFreeGuidanceLogitsProcessor ---------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("scale", [1.5, 3.0])
def test_batched_guidance_equals_transformers(batch, scale):
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, 50, (batch, 7), generator=g)
    scores = torch.randn(2 * batch, 50, generator=g)
    ours = genkit.ClassifierFreeGuidanceLogitsProcessor(scale)(ids, scores)
    theirs = generation.ClassifierFreeGuidanceLogitsProcessor(scale)(ids, scores)
    assert ours.shape == (batch, 50)
    assert torch.equal(ours, theirs)
    assert torch.allclose(ours, scores[batch:] + scale * (scores[:batch] - scores[batch:]))


def test_batched_guidance_refuses_bad_arguments():
    for bad in (1, 0.5, "2", True):
        with pytest.raises(ConfigError, match=r"`guidance_scale` must be a number > 1"):
            genkit.ClassifierFreeGuidanceLogitsProcessor(bad)
    proc = genkit.ClassifierFreeGuidanceLogitsProcessor(2.0)
    with pytest.raises(ConfigError, match="`scores` must have twice the batch size of `input_ids`.*got 3 rows"):
        proc(torch.zeros(2, 4, dtype=torch.long), torch.zeros(3, 10))


# -- BaseWatermarkingConfig --------------------------------------------------------------------------

def test_base_watermarking_config_is_the_base_class_as_in_transformers():
    assert isinstance(genkit.WatermarkingConfig(), genkit.BaseWatermarkingConfig)
    assert issubclass(transformers.WatermarkingConfig, generation.BaseWatermarkingConfig)
    with pytest.raises(TypeError):
        genkit.BaseWatermarkingConfig()  # abstract: validate and construct_processor
    # the dict / JSON methods transformers' base class has, with the same results
    ours, theirs = genkit.WatermarkingConfig(bias=1.5), transformers.WatermarkingConfig(bias=1.5)
    for method in ("from_dict", "to_dict", "to_json_string", "to_json_file", "update", "validate",
                   "construct_processor"):
        assert callable(getattr(genkit.BaseWatermarkingConfig, method))
    assert ours.to_dict() == theirs.to_dict()
    assert json.loads(ours.to_json_string()) == json.loads(theirs.to_json_string())
    assert dict(ours) == dict(theirs)
    assert genkit.WatermarkingConfig.from_dict(theirs.to_dict()) == ours


# -- CompileConfig -----------------------------------------------------------------------------------

def test_compile_config_has_transformers_fields_and_defaults():
    assert genkit.CompileConfig().to_dict() == transformers.CompileConfig().to_dict()
    kw = {"fullgraph": True, "dynamic": False, "backend": "eager", "mode": "max-autotune", "options": {"a": 1}}
    assert genkit.CompileConfig(**kw).to_dict() == transformers.CompileConfig(**kw).to_dict()


def test_compile_config_is_accepted_and_has_no_effect(tmp_path):
    model, ids = tiny_llama(seed=0), torch.tensor([[1, 17, 42, 99, 5]])
    plain = genkit.generate(model, ids, max_new_tokens=8)
    for value in (genkit.CompileConfig(dynamic=True), {"dynamic": True}, transformers.CompileConfig(dynamic=True)):
        config = genkit.GenerationConfig(compile_config=value)
        assert config.compile_config == genkit.CompileConfig(dynamic=True)
        assert torch.equal(genkit.generate(model, ids, max_new_tokens=8, compile_config=value), plain)
    # as in transformers, save_pretrained does not write it
    genkit.GenerationConfig(compile_config=genkit.CompileConfig(), do_sample=True).save_pretrained(tmp_path)
    assert "compile_config" not in json.loads((tmp_path / "generation_config.json").read_text())


@pytest.mark.parametrize(("value", "message"), [
    (3, r"`compile_config` must be a genkit.CompileConfig \(or a dict of its keys\) or None; it has no effect"),
    ({"mode": "fast"}, r'`compile_config.mode` must be "default", "reduce-overhead", "max-autotune" or '
                       r'"max-autotune-no-cudagraphs"; got \'fast\''),
    ({"fullgraph": 1}, r"`compile_config.fullgraph` must be True or False; got 1"),
    ({"dynamic": "yes"}, r"`compile_config.dynamic` must be True, False or None"),
    ({"options": [1]}, r"`compile_config.options` must be a dict or None"),
    ({"backend": ""}, r"`compile_config.backend` must be a backend name or a callable"),
    ({"fulgraph": True}, r"`compile_config` has no key 'fulgraph'; the keys are backend, dynamic, fullgraph"),
])
def test_bad_compile_config_is_refused_naming_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        genkit.GenerationConfig(compile_config=value)
