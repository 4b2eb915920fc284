"""Diverse (group) beam search with a Hamming diversity penalty.

The ``num_beams`` beams are split into ``num_beam_groups`` groups of ``num_beams // num_beam_groups``
beams. Each step the groups are advanced one after the other; before group ``g`` picks its tokens,
every token already picked at this step by groups ``0..g-1`` of the same prompt has its score
lowered by ``diversity_penalty`` times the number of times it was picked (Hamming diversity, Vijayakumar
et al. 2016). Order per group: raw logits -> ``log_softmax`` -> Hamming penalty -> logits processors
-> add the beam scores. Inside a group the step is exactly the vectorised beam step of
``beam_search`` (one :class:`~builtin_strategies.beam_search.BeamTracker` per group), so one group
reproduces plain beam search. At the end the finished hypotheses of all groups of a prompt are
ranked together by score and the best ``num_return_sequences`` are returned.

transformers 5.x moved this strategy to a Hub recipe; genkit ships it built in.
"""

from __future__ import annotations

from typing import Any

import torch

from genkit.generation.outputs import GenerateBeamDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

from .beam_search import BeamRunner, BeamTracker, build_output, check_no_streamer, output_fill_value
from .decoding import _split_criteria


def hamming_penalty(log_probs: torch.Tensor, picked_counts: torch.Tensor, diversity_penalty: float) -> torch.Tensor:
    """``log_probs`` ``(batch, group_beams, vocab)`` minus ``diversity_penalty * picked_counts``
    (``(batch, vocab)``: how often each token was already picked at this step by earlier groups)."""
    if diversity_penalty == 0.0:
        return log_probs
    return log_probs - diversity_penalty * picked_counts[:, None, :].to(log_probs.dtype)


def group_beam_search(
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
    position_ids: torch.Tensor | None = None,
    **unused: Any,
) -> GenerateBeamDecoderOnlyOutput:
    """Diverse beam search over ``num_beam_groups`` groups; see the module docstring."""
    check_no_streamer(streamer, "diverse beam search")
    if unused:
        raise ValueError(f"unexpected model inputs for diverse beam search: {sorted(unused)}")
    cfg = generation_config
    beams, groups = int(cfg.num_beams), int(cfg.num_beam_groups)
    if groups < 1 or beams % groups != 0:
        raise ValueError(f"`num_beams` ({beams}) must be divisible by `num_beam_groups` ({groups}).")
    if cfg.do_sample:
        raise ValueError("diverse beam search (`num_beam_groups` > 1) requires do_sample=False.")
    n_return = int(cfg.num_return_sequences)
    if n_return > beams:
        raise ValueError(f"`num_return_sequences` ({n_return}) must be <= `num_beams` ({beams}).")
    per_group = beams // groups
    penalty = float(cfg.diversity_penalty)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    max_length = stopping_criteria.max_length or cfg.max_length
    others, eos = _split_criteria(stopping_criteria)
    if eos is not None:
        eos = eos.to(device)
    use_cache = bool(use_cache and cfg.use_cache)
    fill = output_fill_value(cfg, eos)
    n_eos = 0 if eos is None else eos.numel()
    base = torch.arange(batch, device=device) * beams
    trackers = [BeamTracker(input_ids, per_group, max_length, fill, n_eos, cfg.length_penalty, cfg.early_stopping,
                            base + g * per_group) for g in range(groups)]
    runner = BeamRunner(model, input_ids, beams, max_length, attention_mask=attention_mask,
                        past_key_values=past_key_values, use_cache=use_cache, position_ids=position_ids,
                        want_hidden=bool(cfg.output_hidden_states))
    want_scores, want_logits, want_hidden = bool(cfg.output_scores), bool(cfg.output_logits), \
        bool(cfg.output_hidden_states)
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    hidden_out: list[Any] = []

    logits, hidden = runner.first_logits, runner.first_hidden
    cur = prompt_len
    while True:
        if want_logits:
            logits_out.append(logits.clone())
        if want_hidden:
            hidden_out.append(hidden)
        vocab = logits.shape[-1]
        log_probs_all = torch.log_softmax(logits, dim=-1).view(batch, groups, per_group, vocab)
        step_scores = torch.empty_like(log_probs_all) if want_scores else None
        counts = torch.zeros((batch, vocab), dtype=torch.long, device=device)
        parents, tokens = [], []
        for g, tracker in enumerate(trackers):
            lp = hamming_penalty(log_probs_all[:, g], counts, penalty)
            lp = logits_processor(tracker.running_ids(cur), lp.reshape(batch * per_group, vocab))
            lp = lp.view(batch, per_group, vocab)
            if step_scores is not None:
                step_scores[:, g] = lp
            tok, par = tracker.step(lp, cur, False, eos, others)
            counts.scatter_add_(1, tok, torch.ones_like(tok))
            tokens.append(tok)
            parents.append(par)
        if step_scores is not None:
            scores_out.append(step_scores.view(batch * beams, vocab))
        cur += 1
        flags = []
        for tracker in trackers:
            tracker.update_stop(cur)
            flags.append(tracker.open_flag())
        if trackers[0].all_hit or not bool(torch.stack(flags).any()):
            break
        seqs_flat = torch.stack([t.seqs[:, :, :cur] for t in trackers], dim=1).reshape(batch * beams, cur)
        logits, hidden = runner.next_logits(seqs_flat, torch.stack(parents, dim=1).reshape(-1))

    if groups == 1:
        seqs, seq_scores, bidx = trackers[0].finished()
    else:
        seqs = torch.cat([t.fin_seqs for t in trackers], dim=1)
        seq_scores = torch.cat([t.fin_scores for t in trackers], dim=1)
        bidx = torch.cat([t.fin_bidx for t in trackers], dim=1)
        # rank only real hypotheses: an unfilled slot of one group never outranks a finished one
        done = torch.cat([t.fin_done for t in trackers], dim=1)
        key = torch.where(done, seq_scores, torch.full_like(seq_scores, -float("inf")))
        order = torch.sort(key, dim=1, descending=True, stable=True).indices
        seq_scores = seq_scores.gather(1, order)
        seqs = seqs.gather(1, order[:, :, None].expand(-1, -1, seqs.shape[-1]))
        bidx = bidx.gather(1, order[:, :, None].expand(-1, -1, bidx.shape[-1]))
    return build_output(seqs, seq_scores, bidx, n_return, prompt_len, cfg, scores_out, logits_out, hidden_out,
                        runner.cache if use_cache else None)
