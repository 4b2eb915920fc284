"""Self-speculative decoding with early exit (``assistant_early_exit``, as in LayerSkip).

The model drafts with its own first ``assistant_early_exit`` layers (then the final norm and the LM
head) and verifies the draft with all its layers in one pass, like assisted decoding with the
model's shallow part as the assistant. There is no second model and no second cache: the draft
writes the first layers of the model's own cache, and the verifying pass runs the drafted
positions through every layer (the stepper drops what only the first layers hold before it).

A round drafts up to ``num_assistant_tokens`` tokens (``num_assistant_tokens_schedule``
``"heuristic"`` grows the number by 2 after a round whose every draft was accepted and shrinks it
by 1 otherwise), stopping after a token whose draft probability is below
``assistant_confidence_threshold`` (0 disables) or that is an EOS token: the policy of transformers
5's ``assistant_early_exit``. Verification is assisted decoding's: under greedy decoding the output is
greedy decoding's, token for token; with ``do_sample`` the speculative sampling rule keeps the
model's distribution.

The counts are logged (logger ``genkit.early_exit``, INFO): new tokens, full-model passes, drafted
and accepted tokens; the log record carries them as ``record.early_exit`` (a dict).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.strategy import (
    ConfigError,
    FinishTracker,
    GenerateDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    choose_tokens,
)

from .assisted import verify_round

logger = logging.getLogger("genkit.early_exit")

__all__ = ["assisted_early_exit", "exit_layer"]


def assisted_early_exit(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Draft with the first ``assistant_early_exit`` layers, verify with the whole model (see module doc)."""
    call = StrategyCall.from_kwargs("early-exit decoding", model, input_ids, **kwargs)
    call.refuse("position_ids")
    config = call.config
    layers = exit_layer(config.assistant_early_exit, model)
    if call.batch != 1:
        raise ConfigError(f"early-exit decoding supports batch size 1 (as assisted decoding does); got input_ids "
                          f"with batch size {call.batch}")
    if not call.use_cache:
        raise ConfigError("early-exit decoding drafts into the model's cache: `use_cache` must be True")
    do_sample = bool(config.do_sample)
    threshold = float(config.assistant_confidence_threshold or 0.0)
    budget = int(config.num_assistant_tokens)
    heuristic = config.num_assistant_tokens_schedule in ("heuristic", "heuristic_transient")
    stepper = Stepper(call)
    record = StepOutputs(call.config)
    passes = drafted_total = accepted_total = 0
    with FinishTracker(call) as finish, stepper.rollback():
        draft_logits: torch.Tensor | None = stepper.prefill(num_layers=layers)
        done = False
        while not done:
            cur = stepper.length
            drafted: list[torch.Tensor] = []
            draft_scores: list[torch.Tensor] = []
            for _ in range(min(budget, call.max_length - cur - 1)):
                if draft_logits is None:
                    draft_logits = stepper.forward(num_layers=layers)
                scores = call.logits_processor(stepper.sequences, draft_logits)
                draft_logits = None
                token = choose_tokens(scores, do_sample, live=finish.unfinished)
                stepper.push(token)
                drafted.append(token)
                draft_scores.append(scores)
                if _ends_draft(token, scores, finish.eos, threshold):
                    break
            k = len(drafted)
            candidates = torch.stack(drafted, dim=1) if k else stepper.ids.new_empty((1, 0))
            candidate_logits = torch.stack(draft_scores, dim=1) if k else None
            n_matches, kept, done, _ = verify_round(call, stepper, finish, record, candidates, candidate_logits, cur)
            passes += 1
            drafted_total += k
            accepted_total += min(n_matches, kept)
            if heuristic:
                budget = budget + 2 if n_matches == k else max(1, budget - 1)
    stats = {"exit_layer": layers, "new_tokens": stepper.length - call.prompt_len, "full_passes": passes,
             "drafted": drafted_total, "accepted": accepted_total}
    logger.info("early exit at layer %d: %d new tokens in %d full-model passes; %d of %d drafted tokens accepted",
                layers, stats["new_tokens"], passes, accepted_total, drafted_total, extra={"early_exit": stats})
    out = record.as_tuples()
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, scores=out["scores"], logits=out["logits"],
                                     past_key_values=stepper.cache, finish_reasons=finish.reasons)


def exit_layer(value: Any, model: Any) -> int:
    """``assistant_early_exit`` checked against the model: the number of layers that draft."""
    total = int(model.config.num_hidden_layers)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < total:
        raise ConfigError(f"`assistant_early_exit` must be a layer count from 1 to {total - 1} (the model has {total} "
                          f"layers; the draft uses fewer than all of them); got {value!r}")
    if not getattr(model, "supports_partial_depth", False):
        raise ConfigError(f"`assistant_early_exit` needs a model whose forward can stop after its first layers "
                          f"(`supports_partial_depth`); {type(model).__name__} cannot")
    return value


def _ends_draft(token: torch.Tensor, scores: torch.Tensor, eos: torch.Tensor | None, threshold: float) -> bool:
    """The draft stops after an EOS token, or a token the shallow model gives less than ``threshold``."""
    if eos is not None and bool(torch.isin(token, eos).any()):
        return True
    if threshold > 0:
        prob = torch.softmax(scores, dim=-1).gather(1, token[:, None])
        return bool((prob < threshold).any())
    return False
