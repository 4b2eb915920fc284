"""Diverse (group) beam search with a Hamming diversity penalty, as transformers 4.x ran it.

The ``num_beams`` beams are split into ``num_beam_groups`` groups of ``num_beams // num_beam_groups``
beams. Each step the groups are advanced one after the other; before group ``g`` picks its tokens,
every token already picked at this step by groups ``0..g-1`` of the same prompt has its score
lowered by ``diversity_penalty`` times the number of times it was picked (Hamming diversity, Vijayakumar
et al. 2016). Order per group: raw logits -> ``log_softmax`` -> Hamming penalty -> logits processors
-> add the beam scores (transformers 4.x put the penalty after ``sequence_bias`` and classifier-free
guidance, before the other processors; ``sequence_bias`` only adds, so the order is the same here).

transformers 5.x moved this strategy to a Hub recipe; genkit ships it built in and follows
transformers 4.x's ``_group_beam_search`` with its ``BeamSearchScorer`` (:class:`GroupTracker`), whose
rules differ from 5.x's beam search in three places:

* a (prompt, group) is *done* when its ``group_size`` finished hypotheses cannot be beaten by the
  step's best continuation -- finished or not (5.x: the best running beam) -- at the current
  length (``max_length`` for ``early_stopping="never"`` with ``length_penalty > 0``), or as soon as
  it has ``group_size`` of them with ``early_stopping=True``; a done group's beams count as the pad
  token in the later groups' penalty;
* reaching ``max_length`` does not finish the candidates of the last step: the best ``group_size``
  that do not end with EOS stay running, and at the end the running beams of the groups not done
  join the finished hypotheses;
* the output is filled with the pad id (the first EOS id when there is none), and of hypotheses
  scoring the same the later group's comes first.

At the end the finished hypotheses of all groups of a prompt are ranked together by score and the
best ``num_return_sequences`` are returned. Beam indices are flat model rows, as in beam search (the
rows of ``scores``: ``compute_transition_scores`` works; 4.x recorded rows inside the group, in an
order that did not match its own ``scores``). One group is beam search (:func:`beam_search`).
"""

from __future__ import annotations

from typing import Any

import torch

from genkit.strategy import ConfigError, GenerateBeamDecoderOnlyOutput

from .beam_common import BeamRun, beam_call, check_beam_choice, take
from .beam_search import BeamTracker, beam_search


def hamming_penalty(log_probs: torch.Tensor, picked_counts: torch.Tensor, diversity_penalty: float) -> torch.Tensor:
    """``log_probs`` ``(batch, group_beams, vocab)`` minus ``diversity_penalty * picked_counts``
    (``(batch, vocab)``: how often each token was already picked at this step by earlier groups)."""
    if diversity_penalty == 0.0:
        return log_probs
    return log_probs - diversity_penalty * picked_counts[:, None, :].to(log_probs.dtype)


class GroupTracker(BeamTracker):
    """One group's hypotheses under transformers 4.x's ``BeamSearchScorer`` rules (module docstring):
    step it with :meth:`BeamRun.ends` (EOS and stopping criteria, not the length) and
    :meth:`close` it at the end."""

    def best_possible(self) -> torch.Tensor:
        return self.best_candidate

    def done(self) -> torch.Tensor:
        """``(batch, 1)`` bool: prompts for which this group is done."""
        done = ~self.can_improve
        if self.early_stopping is True:
            done = done | self.fin_done.all(dim=1, keepdim=True)
        return done

    def close(self, cur_len: int) -> None:
        """At the end (``cur_len`` tokens in the sequences): the running beams of the prompts not
        done join the finished hypotheses."""
        self._merge_finished(self.seqs, self.scores, self.bidx, torch.ones_like(self.fin_done), cur_len - 1)


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
    if groups == 1:
        return beam_search(model, input_ids, **kwargs)
    run = BeamRun(call, beams)
    per_group, penalty, batch = beams // groups, float(cfg.diversity_penalty), call.batch
    pad = int(cfg.pad_token_id) if cfg.pad_token_id is not None else run.fill  # the first EOS id when unset
    base = torch.arange(batch, device=call.device) * beams
    trackers = [GroupTracker(input_ids, per_group, call.max_length, pad, run.n_eos, cfg.length_penalty,
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
            was_done = tracker.done()
            lp = hamming_penalty(log_probs_all[:, g], counts, penalty)
            lp = check_beam_choice(call.logits_processor(tracker.running_ids(cur), lp.reshape(batch * per_group, vocab)),
                                  batch)
            lp = lp.view(batch, per_group, vocab)
            if step_scores is not None:
                step_scores[:, g] = lp
            tok, par = tracker.step(lp, cur, False, run.ends)
            picked = torch.where(was_done, pad, tok) if pad >= 0 else tok  # a done group "picks" the pad
            counts.scatter_add_(1, picked, torch.ones_like(picked))
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
    return run.output(*_ranked(trackers, cur))


def _ranked(trackers: list[GroupTracker], cur_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every group's finished hypotheses of each prompt, best first (of equal scores, the later
    group's first, as 4.x's final sort): ``(seqs, scores, beam rows)``."""
    for tracker in trackers:
        tracker.close(cur_len)
    last_first = trackers[::-1]
    seqs = torch.cat([t.fin_seqs for t in last_first], dim=1)
    seq_scores = torch.cat([t.fin_scores for t in last_first], dim=1)
    bidx = torch.cat([t.fin_bidx for t in last_first], dim=1)
    # rank only real hypotheses: an unfilled slot of one group never outranks a finished one
    done = torch.cat([t.fin_done for t in last_first], dim=1)
    key = torch.where(done, seq_scores, torch.full_like(seq_scores, -float("inf")))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    return take(seqs, order), seq_scores.gather(1, order), take(bidx, order)
