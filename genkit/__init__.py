"""genkit: text generation for PyTorch language models, every decoding strategy a plugin.

``import genkit`` is cheap: torch-heavy names are imported on first use.
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

from .generation.engines import register_engine as _register_engine
from .models.continuous_mixin import register_continuous_batching as _register_continuous_batching

__version__ = "0.1.0"

# A checkout's genkit/ imported from the checkout's root (`python -m genkit` or `python -c` there put
# the working directory first on sys.path) lacks the two subpackages an install maps in from beside it
# (pyproject.toml's package-dir: genkit.builtin_strategies, genkit.sandbox): they are looked for there.
_CHECKOUT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "sandbox")) and all(
        _os.path.isfile(_os.path.join(_CHECKOUT, folder, name))
        for folder, name in (("sandbox", "importer.py"), ("builtin_strategies", "decoding.py"))):
    __path__.append(_CHECKOUT)

# This package wires the layers together (docs/architecture.md): generate(cache_implementation="paged")
# runs on continuous batching, which sits above generation; the engine is named here and imported
# on first use.
_register_engine("paged", "genkit.continuous.paged_generate:paged_generate")
# model.generate_batch() and the other ContinuousMixin methods (genkit.models sits below genkit.continuous)
_register_continuous_batching(**{name: f"genkit.continuous.api:{name}" for name in (
    "generate_batch", "init_continuous_batching", "continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager")})

# public name -> "module:attr"
_LAZY = {
    "GenerationConfig": "genkit.config:GenerationConfig",
    "GenerationMode": "genkit.generation_mode:GenerationMode",
    "set_seed": "genkit.seed:set_seed",
    "generate": "genkit.generation.api:generate",
    "score_prompt": "genkit.generation.scoring:score_prompt",
    "transformers_method": "genkit.generation.recipe_call:transformers_method",
    "GenerationMixin": "genkit.models.mixin:GenerationMixin",
    "GenerateDecoderOnlyOutput": "genkit.strategy.outputs:GenerateDecoderOnlyOutput",
    "GenerateBeamDecoderOnlyOutput": "genkit.strategy.outputs:GenerateBeamDecoderOnlyOutput",
    "GenerateEncoderDecoderOutput": "genkit.strategy.outputs:GenerateEncoderDecoderOutput",
    "GenerateBeamEncoderDecoderOutput": "genkit.strategy.outputs:GenerateBeamEncoderDecoderOutput",
    "compute_transition_scores": "genkit.strategy.outputs:compute_transition_scores",
    "LogitsProcessor": "genkit.strategy.processing:LogitsProcessor",
    "LogitsProcessorList": "genkit.strategy.processing:LogitsProcessorList",
    "StoppingCriteria": "genkit.strategy.processing:StoppingCriteria",
    "StoppingCriteriaList": "genkit.strategy.processing:StoppingCriteriaList",
    "ProcessorContext": "genkit.strategy.processing:ProcessorContext",
    "FieldSpec": "genkit.plugins:FieldSpec",
    "hookimpl": "genkit.hookspecs:hookimpl",
    "get_registry": "genkit.plugins:get_registry",
    "register_plugin": "genkit.plugins:register_plugin",
    "load_model": "genkit.models.loading:load_model",
    "quantize": "genkit.models.quant:quantize",
    "generate_batch": "genkit.continuous:generate_batch",
    "init_continuous_batching": "genkit.continuous:init_continuous_batching",
    "ContinuousBatchingConfig": "genkit.continuous:ContinuousBatchingConfig",
    "ContinuousBatchingManager": "genkit.continuous:ContinuousBatchingManager",
    "ContinuousMixin": "genkit.models.continuous_mixin:ContinuousMixin",
    "Scheduler": "genkit.continuous.scheduler:Scheduler",
    "FIFOScheduler": "genkit.continuous.scheduler:FIFOScheduler",
    "PrefillFirstScheduler": "genkit.continuous.scheduler:PrefillFirstScheduler",
    "load_tokenizer": "genkit.models.loading:load_tokenizer",
    # the one-import swap: transformers' names for load_model / load_tokenizer
    "AutoModelForCausalLM": "genkit.models.auto:AutoModelForCausalLM",
    "AutoTokenizer": "genkit.models.auto:AutoTokenizer",
    "ModelConfig": "genkit.models.base:ModelConfig",
    "KVCache": "genkit.models.cache:KVCache",
    "LlamaForCausalLM": "genkit.models.llama:LlamaForCausalLM",
    # built-in processors, criteria and streamers under their transformers names
    "MaxLengthCriteria": "genkit.strategy.processing:MaxLengthCriteria",
    "MaxTimeCriteria": "genkit.builtin_strategies.stopping:MaxTimeCriteria",
    "EosTokenCriteria": "genkit.strategy.processing:EosTokenCriteria",
    "ConfidenceCriteria": "genkit.builtin_strategies.stopping:ConfidenceCriteria",
    "validate_stopping_criteria": "genkit.builtin_strategies.stopping:validate_stopping_criteria",
    "StopStringCriteria": "genkit.builtin_strategies.stop_strings:StopStringCriteria",
    "TextStreamer": "genkit.builtin_strategies.streamers:TextStreamer",
    "TextIteratorStreamer": "genkit.builtin_strategies.streamers:TextIteratorStreamer",
    "AsyncTextIteratorStreamer": "genkit.builtin_strategies.streamers:AsyncTextIteratorStreamer",
    "BaseStreamer": "genkit.builtin_strategies.streamers:BaseStreamer",
    "WatermarkingConfig": "genkit.watermarking:WatermarkingConfig",
    "BaseWatermarkingConfig": "genkit.watermarking:BaseWatermarkingConfig",
    "CompileConfig": "genkit.compile_config:CompileConfig",
    "WatermarkDetector": "genkit.watermarking:WatermarkDetector",
    "WatermarkDetectorOutput": "genkit.watermarking:WatermarkDetectorOutput",
    "WatermarkLogitsProcessor": "genkit.builtin_strategies.watermark:WatermarkLogitsProcessor",
    "GrammarLogitsProcessor": "genkit.builtin_strategies.structured:GrammarLogitsProcessor",
    "ClassifierFreeGuidanceLogitsProcessor":
        "genkit.builtin_strategies.guidance:ClassifierFreeGuidanceLogitsProcessor",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor":
        "genkit.builtin_strategies.guidance:UnbatchedClassifierFreeGuidanceLogitsProcessor",
}

_PROCESSOR_NAMES = (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper", "RepetitionPenaltyLogitsProcessor",
    "EncoderRepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "EncoderNoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "PresenceFrequencyPenaltyLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "PrefixConstrainedLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "ExponentialDecayLengthPenalty", "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "LogitNormalization",
)
for _name in _PROCESSOR_NAMES:
    _LAZY[_name] = f"genkit.builtin_strategies.logits_process:{_name}"

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'genkit' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover  (re-exports for type checkers; at run time __getattr__ loads them)
    from .config import GenerationConfig as GenerationConfig
    from .generation.api import generate as generate
    from .generation_mode import GenerationMode as GenerationMode
    from .models.mixin import GenerationMixin as GenerationMixin
    from .seed import set_seed as set_seed
    from .strategy.outputs import (
        GenerateBeamDecoderOnlyOutput as GenerateBeamDecoderOnlyOutput,
    )
    from .strategy.outputs import (
        GenerateBeamEncoderDecoderOutput as GenerateBeamEncoderDecoderOutput,
    )
    from .strategy.outputs import (
        GenerateDecoderOnlyOutput as GenerateDecoderOnlyOutput,
    )
    from .strategy.outputs import (
        GenerateEncoderDecoderOutput as GenerateEncoderDecoderOutput,
    )
    from .strategy.outputs import (
        compute_transition_scores as compute_transition_scores,
    )
    from .strategy.processing import LogitsProcessor as LogitsProcessor
    from .strategy.processing import LogitsProcessorList as LogitsProcessorList
    from .strategy.processing import StoppingCriteria as StoppingCriteria
    from .strategy.processing import StoppingCriteriaList as StoppingCriteriaList
