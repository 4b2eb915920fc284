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

from genkit.strategy import ConfigError, GenerateBeamDecoderOnlyOutput

from .beam_common import BeamRun, beam_call, take
from .beam_search import BeamTracker


def hamming_penalty(log_probs: torch.Tensor, picked_counts: torch.Tensor, diversity_penalty: float) -> torch.Tensor:
    """``log_probs`` ``(batch, group_beams, vocab)`` minus ``diversity_penalty * picked_counts``
    (``(batch, vocab)``: how often each token was already picked at this step by earlier groups)."""
    if diversity_penalty == 0.0:
        return log_probs
    return log_probs - diversity_penalty * picked_counts[:, None, :].to(log_probs.dtype)


def group_beam_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Diverse beam search over ``num_beam_groups`` groups; see the module docstring. ``kwargs`` is
    the strategy call (``genkit.strategy.StrategyCall``)."""
    call = beam_call("diverse beam search", model, input_ids, kwargs)
    cfg = call.config
    beams, groups = int(cfg.num_beams), int(cfg.num_beam_groups)
    if groups < 1 or beams % groups != 0:
        raise ConfigError(f"`num_beams` ({beams}) must be divisible by `num_beam_groups` ({groups}).")
    if cfg.do_sample:
        raise ConfigError("diverse beam search (`num_beam_groups` > 1) requires do_sample=False.")
    run = BeamRun(call, beams)
    per_group = beams // groups
    penalty = float(cfg.diversity_penalty)
    batch = call.batch
    base = torch.arange(batch, device=call.device) * beams
    trackers = [BeamTracker(input_ids, per_group, call.max_length, run.fill, run.n_eos, cfg.length_penalty,
                            cfg.early_stopping, base + g * per_group) for g in range(groups)]

    cur = call.prompt_len
    while True:
        log_probs_all = run.log_probs()
        vocab = log_probs_all.shape[-1]
        log_probs_all = log_probs_all.view(batch, groups, per_group, vocab)
        step_scores = torch.empty_like(log_probs_all) if run.outputs.want_scores else None
        counts = torch.zeros((batch, vocab), dtype=torch.long, device=call.device)
        parents, tokens = [], []
        for g, tracker in enumerate(trackers):
            lp = hamming_penalty(log_probs_all[:, g], counts, penalty)
            lp = call.logits_processor(tracker.running_ids(cur), lp.reshape(batch * per_group, vocab))
            lp = lp.view(batch, per_group, vocab)
            if step_scores is not None:
                step_scores[:, g] = lp
            tok, par = tracker.step(lp, cur, False, run.hits)
            counts.scatter_add_(1, tok, torch.ones_like(tok))
            tokens.append(tok)
            parents.append(par)
        if step_scores is not None:
            run.outputs.processed(step_scores.view(batch * beams, vocab))
        cur += 1
        flags = []
        for tracker in trackers:
            tracker.update_stop(cur)
            flags.append(tracker.open_flag())
        if trackers[0].all_hit or not bool(torch.stack(flags).any()):
            break
        run.forward(torch.stack(tokens, dim=1), torch.stack(parents, dim=1))

    if groups == 1:
        return run.output(*trackers[0].finished())
    seqs = torch.cat([t.fin_seqs for t in trackers], dim=1)
    seq_scores = torch.cat([t.fin_scores for t in trackers], dim=1)
    bidx = torch.cat([t.fin_bidx for t in trackers], dim=1)
    # rank only real hypotheses: an unfilled slot of one group never outranks a finished one
    done = torch.cat([t.fin_done for t in trackers], dim=1)
    key = torch.where(done, seq_scores, torch.full_like(seq_scores, -float("inf")))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    return run.output(take(seqs, order), seq_scores.gather(1, order), take(bidx, order))
