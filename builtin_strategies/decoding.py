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

from .loop_state import StepOutputs, mask_buffer, open_cache, read_inputs, sequence_buffer, uncached_prompt


def greedy_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Pick the highest-scoring token at each step."""
    return decode_loop(model, input_ids, do_sample=False, **kwargs)


def sample(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Draw each token from the softmax of the processed scores."""
    return decode_loop(model, input_ids, do_sample=True, **kwargs)


def decode_loop(model: Any, input_ids: torch.Tensor, *, do_sample: bool, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    run = read_inputs("this strategy", model, input_ids, **kwargs)
    cfg, eos, others, max_length = run.config, run.eos, run.others, run.max_length
    logits_processor, streamer, use_cache = run.logits_processor, run.streamer, run.use_cache
    prompt_len = run.prompt_len
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    seqs = sequence_buffer(input_ids, max_length, pad_id)
    mask_buf, next_pos = mask_buffer(run.attention_mask, max_length)
    cache = open_cache(model, run.past_key_values, use_cache, max_length)
    record = StepOutputs(cfg)
    unfinished = torch.ones(run.batch, dtype=torch.bool, device=run.device)
    may_finish_early = eos is not None or bool(others)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    cur = prompt_len
    want_hidden = record.want_hidden
    first_ids, first_pos = uncached_prompt(input_ids, cache if use_cache else None, run.position_ids)
    out = model(first_ids, attention_mask=run.attention_mask if mask_buf is not None else None,
                position_ids=first_pos, past_key_values=cache, use_cache=use_cache,
                output_hidden_states=want_hidden, logits_to_keep=1)
    while True:
        logits = out.logits[:, -1, :].float()  # a view of the model's output when it is float32 already
        record.model_step(logits, out.hidden_states)
        scores = logits_processor(seqs[:, :cur], logits)
        # kept scores must not hold the model's output (all positions when a model ignores
        # logits_to_keep; a buffer the next forward overwrites when a model reuses one)
        record.processed(scores, copy=scores.untyped_storage().data_ptr() == out.logits.untyped_storage().data_ptr())
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

    return GenerateDecoderOnlyOutput(sequences=seqs[:, :cur], past_key_values=cache if use_cache else None,
                                     **record.as_tuples())
