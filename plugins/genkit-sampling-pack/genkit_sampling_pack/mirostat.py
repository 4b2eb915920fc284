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

from genkit.builtin_strategies.loop_state import (
    mask_buffer,
    open_cache,
    read_inputs,
    sequence_buffer,
    uncached_prompt,
)
from genkit.generation.outputs import GenerateDecoderOnlyOutput

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
    ``generation_config``, ``streamer`` and the model inputs), read once by genkit's ``read_inputs``.
    """
    inp = read_inputs("the mirostat strategy", model, input_ids, **kwargs)
    if inp.position_ids is not None:
        raise ValueError("unexpected model inputs for the mirostat strategy: ['position_ids']")
    cfg, streamer, use_cache, max_length = inp.config, inp.streamer, inp.use_cache, inp.max_length
    tau = 5.0 if cfg.mirostat_tau is None else float(cfg.mirostat_tau)
    eta = float(cfg.mirostat_eta)
    eos = cfg.eos_token_id
    eos_ids = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                           dtype=torch.long, device=inp.device)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    seqs = sequence_buffer(input_ids, max_length, pad_id)
    mask, _ = mask_buffer(inp.attention_mask, max_length)  # positions: the model derives them from the mask
    cache = open_cache(model, inp.past_key_values, use_cache, max_length)
    mu = torch.full((inp.batch,), 2.0 * tau, device=inp.device)
    unfinished = torch.ones(inp.batch, dtype=torch.bool, device=inp.device)
    scores_out: list[torch.Tensor] = []
    if streamer is not None:
        streamer.put(input_ids.cpu())

    cur = inp.prompt_len
    first_ids, _ = uncached_prompt(input_ids, cache if use_cache else None, None)  # a passed cache may hold a prefix
    out = model(first_ids, attention_mask=None if mask is None else mask[:, :cur], past_key_values=cache,
                use_cache=use_cache, logits_to_keep=1)
    while True:
        scores = inp.logits_processor(seqs[:, :cur], out.logits[:, -1, :].float())
        tokens, new_mu, truncated = mirostat_step(scores, mu, tau, eta)
        mu = torch.where(unfinished, new_mu, mu)
        tokens = torch.where(unfinished, tokens, torch.full_like(tokens, pad_id))
        if cfg.output_scores:
            scores_out.append(truncated)
        seqs[:, cur] = tokens
        cur += 1
        if streamer is not None:
            streamer.put(tokens.cpu())
        if eos_ids.numel():
            unfinished = unfinished & ~torch.isin(tokens, eos_ids)
        unfinished = unfinished & ~inp.stopping_criteria(seqs[:, :cur], scores)
        if cur >= max_length or not bool(unfinished.any()):
            break
        step = seqs[:, cur - 1:cur] if use_cache else seqs[:, :cur]
        out = model(step, attention_mask=None if mask is None else mask[:, :cur],
                    past_key_values=cache if use_cache else None, use_cache=use_cache, logits_to_keep=1)
    return GenerateDecoderOnlyOutput(
        sequences=seqs[:, :cur],
        scores=tuple(scores_out) if cfg.output_scores else None,
        past_key_values=cache if use_cache else None,
    )
