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

from genkit.generation.outputs import GenerateDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

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


def mirostat_decode(
    model: Any,
    input_ids: torch.Tensor,
    *,
    logits_processor: Any,
    stopping_criteria: StoppingCriteriaList,
    generation_config: Any,
    streamer: Any = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = True,
    **unused: Any,
) -> GenerateDecoderOnlyOutput:
    """Generate with Mirostat v2 (reads ``mirostat_tau`` — default 5.0 when unset — and
    ``mirostat_eta`` from the config). Batched; left padding via ``attention_mask``."""
    if unused:
        raise ValueError(f"unexpected model inputs for the mirostat strategy: {sorted(unused)}")
    cfg = generation_config
    tau = 5.0 if cfg.mirostat_tau is None else float(cfg.mirostat_tau)
    eta = float(cfg.mirostat_eta)
    batch = input_ids.shape[0]
    device = input_ids.device
    max_length = stopping_criteria.max_length or cfg.max_length
    eos = cfg.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                           dtype=torch.long, device=device)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    use_cache = use_cache and cfg.use_cache

    seqs = input_ids
    mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
    cache = past_key_values
    if cache is None and use_cache and hasattr(model, "new_cache"):
        cache = model.new_cache(max_length)
    mu = torch.full((batch,), 2.0 * tau, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    scores_out: list[torch.Tensor] = []
    if streamer is not None:
        streamer.put(input_ids.cpu())

    out = model(seqs, attention_mask=mask, past_key_values=cache, use_cache=use_cache, logits_to_keep=1)
    while True:
        scores = logits_processor(seqs, out.logits[:, -1, :].float())
        tokens, new_mu, truncated = mirostat_step(scores, mu, tau, eta)
        mu = torch.where(unfinished, new_mu, mu)
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_id))
        if cfg.output_scores:
            scores_out.append(truncated)
        seqs = torch.cat([seqs, tokens[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
        if streamer is not None:
            streamer.put(tokens.cpu())
        if eos_ids.numel():
            unfinished = unfinished & ~torch.isin(tokens, eos_ids)
        unfinished = unfinished & ~stopping_criteria(seqs, scores)
        if seqs.shape[1] >= max_length or not bool(unfinished.any()):
            break
        step = seqs[:, -1:] if use_cache else seqs
        out = model(step, attention_mask=mask, past_key_values=cache if use_cache else None,
                    use_cache=use_cache, logits_to_keep=1)
    return GenerateDecoderOnlyOutput(
        sequences=seqs,
        scores=tuple(scores_out) if cfg.output_scores else None,
        past_key_values=cache if use_cache else None,
    )
