"""``genkit.strategy``: the kit that decoding strategies are written with.

Built-in strategies and packs import from here (and from ``genkit`` itself) only. A strategy is a
function ``decode(model, input_ids, *, logits_processor, stopping_criteria, generation_config,
streamer, **model_inputs)``; with the kit its loop reads::

    from genkit.strategy import FinishTracker, Stepper, StepOutputs, StrategyCall, choose_tokens
    from genkit.strategy import GenerateDecoderOnlyOutput

    def my_decode(model, input_ids, **kwargs):
        call = StrategyCall.from_kwargs("my strategy", model, input_ids, **kwargs)
        stepper = Stepper(call)                    # cache, attention mask, positions, sequences
        with FinishTracker(call) as finish:        # EOS, max length, criteria, the streamer
            logits = stepper.prefill()
            while True:
                scores = call.logits_processor(stepper.sequences, logits)
                tokens = finish.pad(choose_tokens(scores, do_sample=False, live=finish.unfinished))
                stepper.push(tokens)
                if finish.update(stepper.sequences, scores, tokens):
                    break
                logits = stepper.forward()
        return GenerateDecoderOnlyOutput(sequences=stepper.sequences, past_key_values=stepper.cache)

* :class:`StrategyCall` — the call as one frozen object: ``input_ids``, ``config``,
  ``logits_processor``, ``stop`` (:class:`StopConditions`), ``streamer``, the model inputs
  (``attention_mask``, ``past_key_values``, ``position_ids``, ``use_cache``) and ``extras``.
* :class:`Stepper` — ``prefill() -> logits``, ``step(tokens, rows=None) -> logits`` (or
  ``push`` + ``forward``), ``crop(length)``, ``hidden_states``, partial depth (``num_layers=``).
* :class:`FinishTracker` — ``pad``, ``update``, ``hits``, ``unfinished``, ``reasons``; ends the
  streamer. The finish decision itself is :func:`finish_codes` (reasons :data:`FINISH_REASONS`),
  the EOS ids are read by :func:`eos_token_ids`.
* :func:`choose_tokens` / :func:`choose` — the sampler (token, log-probability, top alternatives),
  :mod:`genkit.strategy.sampling`; every engine picks tokens with it.
* :class:`StepOutputs` — the per-step scores / logits / hidden states the config asks for.
* the protocols of :mod:`genkit.protocols` (``Cache``, ``CausalLM``, ``CandidateGenerator``,
  ``Streamer``) and the output classes.

See ``docs/hooks.md`` ("Write a strategy") for a tutorial.
"""

from __future__ import annotations

from genkit.config.checks import model_vocab_size
from genkit.errors import ConfigError, GenkitError, NotSupportedError
from genkit.protocols import Cache, CandidateGenerator, CausalLM, ModelOutput, PartialDepthLM, Streamer

from .call import MODEL_INPUTS, StopConditions, StrategyCall
from .finish import (
    FINISH_REASONS,
    FinishTracker,
    StreamerOnce,
    eos_token_ids,
    finish_codes,
    openai_finish_reason,
    reason_names,
)
from .outputs import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)
from .processing import LogitsProcessorList, StoppingCriteriaList
from .record import StepOutputs
from .sampling import Choice, check_choosable, choose, choose_tokens, log_probs
from .stepper import Stepper

__all__ = [
    "FINISH_REASONS", "MODEL_INPUTS", "Cache", "CandidateGenerator", "CausalLM", "Choice", "ConfigError",
    "FinishTracker", "choose", "eos_token_ids", "finish_codes", "log_probs", "openai_finish_reason", "reason_names",
    "GenerateBeamDecoderOnlyOutput", "GenerateBeamEncoderDecoderOutput", "GenerateDecoderOnlyOutput",
    "GenerateEncoderDecoderOutput", "GenkitError", "LogitsProcessorList",
    "ModelOutput", "NotSupportedError", "PartialDepthLM", "StepOutputs", "Stepper", "StopConditions",
    "StoppingCriteriaList", "StrategyCall", "Streamer", "StreamerOnce", "check_choosable", "choose_tokens",
    "model_vocab_size",
]

