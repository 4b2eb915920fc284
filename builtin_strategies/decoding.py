"""Greedy search and multinomial sampling: one token per step, batched, padding-aware.

The loop does no wasted work: the output buffer and the cache are sized once, the model returns
only the last position's logits, the built-in stopping criteria (max length, EOS) run as tensor
ops without building objects, and the only host sync per step is the "all rows done?" check.
"""

from __future__ import annotations

from typing import Any

import torch

from genkit.generation.outputs import GenerateDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

from .stopping import EosTokenCriteria, MaxLengthCriteria


def greedy_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Pick the highest-scoring token at each step."""
    return decode_loop(model, input_ids, do_sample=False, **kwargs)


def sample(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Draw each token from the softmax of the processed scores."""
    return decode_loop(model, input_ids, do_sample=True, **kwargs)


def _split_criteria(criteria: StoppingCriteriaList) -> tuple[list[Any], torch.Tensor | None]:
    """Built-in max-length and EOS criteria are handled inline; return the others and EOS ids."""
    others, eos = [], []
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            continue
        if type(c) is EosTokenCriteria:
            eos.append(c.eos_token_id.view(-1))
            continue
        others.append(c)
    return others, (torch.cat(eos) if eos else None)


def decode_loop(
    model: Any,
    input_ids: torch.Tensor,
    *,
    logits_processor: Any,
    stopping_criteria: StoppingCriteriaList,
    generation_config: Any,
    streamer: Any = None,
    do_sample: bool,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    use_cache: bool = True,
    position_ids: torch.Tensor | None = None,
    **unused: Any,
) -> GenerateDecoderOnlyOutput:
    if unused:
        raise ValueError(f"unexpected model inputs for this strategy: {sorted(unused)}")
    cfg = generation_config
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    max_length = stopping_criteria.max_length or cfg.max_length
    use_cache = use_cache and cfg.use_cache
    others, eos = _split_criteria(stopping_criteria)
    if eos is not None:
        eos = eos.to(device)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0

    seqs = torch.empty((batch, max_length), dtype=torch.long, device=device)
    seqs[:, :prompt_len] = input_ids
    padded = attention_mask is not None and not bool(attention_mask.all())
    mask_buf = None
    next_pos = None
    if padded:
        assert attention_mask is not None
        mask_buf = torch.ones((batch, max_length), dtype=attention_mask.dtype, device=device)
        mask_buf[:, :prompt_len] = attention_mask
        next_pos = attention_mask.sum(-1, keepdim=True)  # (batch, 1): position of the next token
    cache = past_key_values
    if cache is None and use_cache and hasattr(model, "new_cache"):
        cache = model.new_cache(max_length)

    want_scores, want_logits = cfg.output_scores, bool(cfg.output_logits)
    want_hidden = cfg.output_hidden_states
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    hidden_out: list[Any] = []
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    may_finish_early = eos is not None or bool(others)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    cur = prompt_len
    out = model(input_ids, attention_mask=attention_mask if padded else None, position_ids=position_ids,
                past_key_values=cache, use_cache=use_cache, output_hidden_states=want_hidden, logits_to_keep=1)
    while True:
        logits = out.logits[:, -1, :].float()  # a fresh tensor each step: processors may edit it in place
        if want_hidden:
            hidden_out.append(out.hidden_states)
        if want_logits:
            logits_out.append(logits.clone())
        scores = logits_processor(seqs[:, :cur], logits)
        if want_scores:
            scores_out.append(scores)
        if do_sample:
            probs = torch.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        if eos is not None:
            next_tokens = torch.where(unfinished, next_tokens, pad_id)
        seqs[:, cur] = next_tokens
        cur += 1
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        if eos is not None:
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
        if others:
            unfinished = unfinished & ~StoppingCriteriaList(others)(seqs[:, :cur], scores)
        if cur >= max_length or (may_finish_early and not bool(unfinished.any())):
            break
        if use_cache:
            step_ids = seqs[:, cur - 1:cur]
            step_mask = mask_buf[:, :cur] if mask_buf is not None else None
            step_pos = None
            if next_pos is not None:
                step_pos = next_pos
                next_pos = next_pos + 1
            out = model(step_ids, attention_mask=step_mask, position_ids=step_pos, past_key_values=cache,
                        use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1)
        else:
            out = model(seqs[:, :cur], attention_mask=mask_buf[:, :cur] if mask_buf is not None else None,
                        use_cache=False, output_hidden_states=want_hidden, logits_to_keep=1)

    return GenerateDecoderOnlyOutput(
        sequences=seqs[:, :cur],
        scores=tuple(scores_out) if want_scores else None,
        logits=tuple(logits_out) if want_logits else None,
        hidden_states=tuple(hidden_out) if want_hidden else None,
        past_key_values=cache if use_cache else None,
    )
