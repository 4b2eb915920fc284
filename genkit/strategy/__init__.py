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
                tokens = finish.pad(choose_tokens(scores, do_sample=False))
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
* :class:`FinishTracker` — ``pad``, ``update``, ``hits``, ``unfinished``; ends the streamer.
* :class:`StepOutputs` — the per-step scores / logits / hidden states the config asks for.
* the protocols of :mod:`genkit.protocols` (``Cache``, ``CausalLM``, ``CandidateGenerator``,
  ``Streamer``) and the output classes.

See ``docs/hooks.md`` ("Write a strategy") for a tutorial.
"""

from __future__ import annotations

import torch

from genkit.errors import ConfigError, GenkitError, NotSupportedError
from genkit.protocols import Cache, CandidateGenerator, CausalLM, ModelOutput, PartialDepthLM, Streamer

from .call import MODEL_INPUTS, StopConditions, StrategyCall
from .finish import FinishTracker, StreamerOnce
from .outputs import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput
from .processing import LogitsProcessorList, StoppingCriteriaList
from .record import StepOutputs
from .stepper import Stepper

__all__ = [
    "MODEL_INPUTS", "Cache", "CandidateGenerator", "CausalLM", "ConfigError", "FinishTracker",
    "GenerateBeamDecoderOnlyOutput", "GenerateDecoderOnlyOutput", "GenkitError", "LogitsProcessorList",
    "ModelOutput", "NotSupportedError", "PartialDepthLM", "StepOutputs", "Stepper", "StopConditions",
    "StoppingCriteriaList", "StrategyCall", "Streamer", "StreamerOnce", "choose_tokens",
]


def choose_tokens(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from processed ``scores`` ``(rows, vocab)``: the argmax, or a draw from
    their softmax with ``do_sample``."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    return scores.argmax(dim=-1)
