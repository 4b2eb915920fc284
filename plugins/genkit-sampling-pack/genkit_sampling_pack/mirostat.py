"""Mirostat v2 decoding (Basu et al., 2021, "Mirostat: a neural text decoding algorithm that
directly controls perplexity"), as a genkit strategy.

Each row keeps a threshold ``mu`` (initially ``2 * tau``). At each step, after the logits
processors, tokens whose surprise ``-log2 p`` exceeds ``mu`` are dropped (the most likely token
always stays), a token is sampled from the renormalised rest, and ``mu`` moves by
``eta * (tau - observed surprise)``, where the observed surprise is measured on the truncated
distribution. Over a generation the average surprise settles near ``tau``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from genkit.strategy import FinishTracker, GenerateDecoderOnlyOutput, StepOutputs, Stepper, StrategyCall

__all__ = ["mirostat_decode", "mirostat_step"]

_LN2 = math.log(2.0)


def mirostat_step(scores: torch.Tensor, mu: torch.Tensor, tau: float, eta: float,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Mirostat v2 step over a batch. Returns (tokens, new mu, truncated scores)."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    surprise = -logp / _LN2
    keep = surprise <= mu[:, None]
    keep[torch.arange(scores.shape[0]), scores.argmax(dim=-1)] = True
    truncated = scores.float().masked_fill(~keep, float("-inf"))
    probs = torch.softmax(truncated, dim=-1)
    tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
    observed = -torch.log2(probs.gather(1, tokens[:, None]).squeeze(1))
    return tokens, mu - eta * (observed - tau), truncated


def mirostat_decode(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Generate with Mirostat v2 (reads ``mirostat_tau`` — default 5.0 when unset — and
    ``mirostat_eta`` from the config). Batched; left padding via ``attention_mask``.

    ``kwargs`` is the strategy call (``logits_processor``, ``stopping_criteria``,
    ``generation_config``, ``streamer`` and the model inputs), read once by
    :meth:`genkit.strategy.StrategyCall.from_kwargs`.
    """
    call = StrategyCall.from_kwargs("the mirostat strategy", model, input_ids, **kwargs)
    call.refuse("position_ids")
    cfg = call.config
    tau = 5.0 if cfg.mirostat_tau is None else float(cfg.mirostat_tau)
    eta = float(cfg.mirostat_eta)
    record = StepOutputs(cfg)
    stepper = Stepper(call, output_hidden_states=record.want_hidden)
    mu = torch.full((call.batch,), 2.0 * tau, device=call.device)
    with FinishTracker(call) as finish:
        logits = stepper.prefill()
        while True:
            record.model_step(logits, stepper.hidden_states)
            scores = call.logits_processor(stepper.sequences, logits)
            tokens, new_mu, truncated = mirostat_step(scores, mu, tau, eta)
            record.processed(truncated)
            mu = torch.where(finish.unfinished, new_mu, mu)
            tokens = finish.pad(tokens)
            stepper.push(tokens)
            if finish.update(stepper.sequences, scores, tokens):
                break
            logits = stepper.forward()
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, past_key_values=stepper.cache,
                                     **record.as_tuples())
