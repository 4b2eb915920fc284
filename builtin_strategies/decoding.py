"""Greedy search and multinomial sampling: one token per step, batched, padding-aware.

Written on :mod:`genkit.strategy`: the :class:`~genkit.strategy.Stepper` sizes the sequences and
the cache once and returns only the last position's logits; the
:class:`~genkit.strategy.FinishTracker` checks max length and EOS as tensor ops; the only host
sync per step is its "all rows done?" check.
"""

from __future__ import annotations

from typing import Any

import torch

from genkit.strategy import (
    FinishTracker,
    GenerateDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    choose_tokens,
)

from .logits_process import top_k_first


def greedy_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Pick the highest-scoring token at each step."""
    return decode_loop(StrategyCall.from_kwargs("greedy search", model, input_ids, **kwargs), do_sample=False)


def sample(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Draw each token from the softmax of the processed scores."""
    return decode_loop(StrategyCall.from_kwargs("sampling", model, input_ids, **kwargs), do_sample=True)


def decode_loop(call: StrategyCall, *, do_sample: bool) -> GenerateDecoderOnlyOutput:
    """One token per row per step until max length, or every row finished."""
    record = StepOutputs(call.config)
    stepper = Stepper(call, output_hidden_states=record.want_hidden)
    processors = call.logits_processor
    with FinishTracker(call) as finish:
        logits: torch.Tensor | None = stepper.prefill()
        recording = record.recording
        # greedy with nothing reading the scores: the model may give the argmax alone (Stepper.forward_greedy);
        # sampling that filters to the k largest first: only the logits that can be among them (forward_top)
        argmax_only = (not do_sample and not recording and isinstance(processors, list) and not processors
                       and not finish.reads_scores)
        top_k = top_k_first(processors) if do_sample and not record.want_logits else None
        chosen = scores = None
        while True:
            if logits is None:  # the model gave the tokens: no scores this step
                scores = None
            else:
                if recording:
                    record.model_step(logits, stepper.hidden_states, stepper.attentions)
                scores = processors(stepper.sequences, logits)
                if recording:  # kept scores must not share the model's output buffer (a model may reuse it)
                    record.processed(scores,
                                     copy=scores.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr())
                chosen = choose_tokens(scores, do_sample, live=finish.unfinished)
            tokens = finish.pad(chosen)
            stepper.push(tokens)
            if finish.update(stepper.sequences, scores, tokens):
                break
            chosen = stepper.forward_greedy() if argmax_only else None
            logits = None if chosen is not None else stepper.forward_top(top_k) if top_k else None
            if chosen is None and logits is None:
                logits = stepper.forward()
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, past_key_values=stepper.cache,
                                     finish_reasons=finish.reasons, **record.as_tuples())
