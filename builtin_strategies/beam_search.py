"""Beam search and beam-search multinomial sampling, vectorised over (batch, beams).

Every hypothesis lives in tensors of shape ``(batch, beams, ...)``: the running beams, and the
best finished hypotheses found so far. One step scores ``beams * vocab`` continuations per prompt,
keeps the best ``K = max(2, 1 + n_eos) * beams`` of them (or samples them without replacement),
moves those that hit a stopping criterion into the finished set (with the length penalty), and
keeps the best unfinished ``beams`` as the next running set. There are no per-hypothesis Python
objects and the only host sync per step is the "is anything left to do?" check.

Semantics follow transformers 5.x so that the same weights give the same sequences and scores:

* per step: raw logits -> ``log_softmax`` -> logits processors -> add the running beam score;
* a finished hypothesis scores ``sum_logprobs / generated_length ** length_penalty``;
* ``early_stopping=True`` stops a prompt as soon as ``num_beams`` hypotheses are finished;
  ``False`` stops when the best running beam, normalised at the current length, cannot beat the
  worst finished one; ``"never"`` does the same check at the best length reachable (``max_length``
  when ``length_penalty > 0``).

The prompt is run through the model once per prompt and the cache is then repeated for each beam
(``cache.repeat_interleave(num_beams)``); after each step the cache follows the surviving beams
with ``cache.reorder(index)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from genkit.strategy import ConfigError, GenerateBeamDecoderOnlyOutput

from .beam_common import (
    NEG,
    BeamRun,
    beam_call,
    check_beam_choice,
    extend,
    length_normalizer,
    sequence_buffer,
    take,
)

logger = logging.getLogger("genkit.beam")


class BeamTracker:
    """Running and finished hypotheses of ``batch`` prompts with ``beams`` beams each.

    ``row_base`` gives, per prompt, the flat row (in the model batch) of this tracker's first beam:
    plain beam search uses ``b * beams``; a group of diverse beam search adds its group offset.
    Beam indices are recorded as flat rows, the convention of ``compute_transition_scores``.
    """

    def __init__(self, prompt: torch.Tensor, beams: int, max_length: int, fill_value: int, n_eos: int,
                 length_penalty: float, early_stopping: bool | str, row_base: torch.Tensor) -> None:
        batch, prompt_len = prompt.shape
        device = prompt.device
        self.batch, self.beams, self.prompt_len, self.max_length = batch, beams, prompt_len, max_length
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.keep = max(2, 1 + n_eos) * beams  # candidates kept per step
        self.row_base = row_base.view(batch, 1).to(device)
        self.seqs = sequence_buffer(prompt, max_length, fill_value, beams)
        self.scores = torch.full((batch, beams), NEG, dtype=torch.float32, device=device)
        self.scores[:, 0] = 0.0  # only the first beam is live at the start: no duplicate hypotheses
        self.bidx = torch.full((batch, beams, max_length - prompt_len), -1, dtype=torch.long, device=device)
        self.fin_seqs = self.seqs.clone()
        self.fin_scores = torch.full((batch, beams), NEG, dtype=torch.float32, device=device)
        self.fin_bidx = self.bidx.clone()
        self.fin_done = torch.zeros((batch, beams), dtype=torch.bool, device=device)
        self.can_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.top_mask = torch.arange(self.keep, device=device) < beams  # (keep,)
        self.all_hit = False
        self.hits = torch.zeros((batch, self.keep), dtype=torch.bool, device=device)
        self.best_candidate = self.scores[:, :1]

    # -- per step -----------------------------------------------------------------------------
    def running_ids(self, cur_len: int) -> torch.Tensor:
        """Running sequences as the model batch sees them: ``(batch * beams, cur_len)``."""
        return self.seqs[:, :, :cur_len].reshape(self.batch * self.beams, cur_len)

    def step(self, log_probs: torch.Tensor, cur_len: int, do_sample: bool,
             hits_of: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance by one token from processed ``log_probs`` ``(batch, beams, vocab)``.

        ``hits_of(tokens, cand_seqs, cur_len)`` tells which candidates end (``BeamRun.hits``).
        Returns ``(next_tokens, parent_rows)``, both ``(batch, beams)``: the last token of each new
        running beam and the flat model row it continues (for the cache reorder).
        """
        batch, beams = self.batch, self.beams
        vocab = log_probs.shape[-1]
        total = (log_probs + self.scores[:, :, None]).view(batch, beams * vocab)
        if do_sample:
            picked = torch.multinomial(torch.softmax(total, dim=-1), num_samples=self.keep)
            # best first, as transformers >= 5.24 orders them: the order decides which rows the
            # running beams take, and so which beam the next step's samples map to
            cand_scores, order = total.gather(1, picked).sort(dim=1, descending=True)
            picked = picked.gather(1, order)
        else:
            cand_scores, picked = torch.topk(total, self.keep, dim=1)
        parent = picked // vocab  # (batch, keep) beam within this tracker
        tokens = picked % vocab
        parent_rows = parent + self.row_base
        cand_seqs, cand_bidx = extend(self.seqs, self.bidx, parent, tokens, parent_rows, cur_len, self.prompt_len)
        hits = hits_of(tokens, cand_seqs, cur_len)
        self.all_hit = cur_len + 1 >= self.max_length
        self.hits = hits
        self.best_candidate = cand_scores[:, :1]  # the step's best continuation, finished or not

        # next running beams: the best candidates that are not finished
        live_scores = cand_scores + hits.to(torch.float32) * NEG
        order = torch.topk(live_scores, beams, dim=1).indices
        self.seqs = take(cand_seqs, order)
        self.scores = live_scores.gather(1, order)
        self.bidx = take(cand_bidx, order)

        # finished set: merge the candidates that just finished among the top `beams`
        self._merge_finished(cand_seqs, cand_scores, cand_bidx, hits & self.top_mask[None, :], cur_len)
        return tokens.gather(1, order), parent_rows.gather(1, order)

    def _merge_finished(self, cand_seqs: torch.Tensor, cand_scores: torch.Tensor, cand_bidx: torch.Tensor,
                        just_finished: torch.Tensor, cur_len: int) -> None:
        normed = cand_scores / length_normalizer(cur_len + 1 - self.prompt_len, self.length_penalty)
        # what may not enter is pushed down by NEG, added as transformers adds it: a candidate the
        # processors ruled out (-inf) stays below an empty slot (NEG), never ties with it
        if self.early_stopping is True:
            normed = normed + self.fin_done.all(dim=1, keepdim=True).to(torch.float32) * NEG
        normed = normed + (~self.can_improve).to(torch.float32) * NEG
        normed = normed + (~just_finished).to(torch.float32) * NEG
        all_scores = torch.cat((self.fin_scores, normed), dim=1)
        best = torch.topk(all_scores, self.beams, dim=1).indices
        self.fin_scores = all_scores.gather(1, best)
        self.fin_seqs = take(torch.cat((self.fin_seqs, cand_seqs), 1), best)
        self.fin_bidx = take(torch.cat((self.fin_bidx, cand_bidx), 1), best)
        self.fin_done = torch.cat((self.fin_done, just_finished), 1).gather(1, best)

    def best_possible(self) -> torch.Tensor:
        """``(batch, 1)``: the sum of log-probs the early-stop heuristic weighs against the worst
        finished hypothesis -- the best running beam's (transformers 5.x)."""
        return self.scores[:, :1]

    def update_stop(self, new_len: int) -> None:
        """After a step (``new_len`` = tokens now in the sequences): can running beams still win?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = new_len - self.prompt_len
        best_running = self.best_possible() / length_normalizer(best_len, self.length_penalty)
        worst_finished = torch.where(self.fin_done, self.fin_scores.min(dim=1, keepdim=True).values,
                                     torch.full_like(self.fin_scores, NEG))
        self.can_improve = self.can_improve & (best_running > worst_finished).any(dim=1, keepdim=True)

    def open_flag(self) -> torch.Tensor:
        """0-d bool tensor: does this tracker want another step (before the max-length check)?"""
        flag = self.can_improve.any() & ~self.hits.all()
        if self.early_stopping is True:
            flag = flag & ~self.fin_done.all()
        return flag

    def finished(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finished hypotheses, best first: ``(seqs (batch, beams, L), scores, beam rows)``."""
        return self.fin_seqs, self.fin_scores, self.fin_bidx


def beam_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Beam search: keep the ``num_beams`` best-scoring hypotheses at every step."""
    return beam_decode(model, input_ids, do_sample=False, **kwargs)


def beam_sample(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Beam-search multinomial sampling: draw the kept continuations from the softmax of the
    accumulated scores (without replacement) instead of taking the top ones."""
    return beam_decode(model, input_ids, do_sample=True, **kwargs)


def beam_decode(model: Any, input_ids: torch.Tensor, *, do_sample: bool, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """The beam loop behind ``beam_search`` and ``beam_sample``; ``input_ids`` is ``(batch, prompt)``
    (not yet expanded to the beams); ``kwargs`` is the strategy call (``genkit.strategy.StrategyCall``)."""
    name = "beam sampling" if do_sample else "beam search"
    call = beam_call(name, model, input_ids, kwargs)
    beams = int(call.config.num_beams)
    if beams < 1:
        raise ConfigError(f"`num_beams` must be >= 1 for {name}; got {beams}")
    run = BeamRun(call, beams)
    tracker = BeamTracker(input_ids, beams, call.max_length, run.fill, run.n_eos, call.config.length_penalty,
                          call.config.early_stopping, torch.arange(call.batch, device=call.device) * beams)
    cur = call.prompt_len
    while True:
        log_probs = check_beam_choice(call.logits_processor(run.stepper.sequences, run.log_probs()), call.batch)
        run.outputs.processed(log_probs, copy=True)
        tokens, parents = tracker.step(log_probs.view(call.batch, beams, -1), cur, do_sample, run.hits)
        cur += 1
        tracker.update_stop(cur)
        if tracker.all_hit or not bool(tracker.open_flag()):
            break
        run.forward(tokens, parents)
    return run.output(*tracker.finished())
