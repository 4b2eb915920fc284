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
from typing import Any

import torch

from genkit.generation.outputs import GenerateBeamDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

from .decoding import _split_criteria

logger = logging.getLogger("genkit.beam")

_NEG = -1.0e9  # score given to slots that must not be chosen (finite, so sums stay ordered)


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
        self.seqs = torch.full((batch, beams, max_length), fill_value, dtype=torch.long, device=device)
        self.seqs[:, :, :prompt_len] = prompt[:, None, :]
        self.scores = torch.full((batch, beams), _NEG, dtype=torch.float32, device=device)
        self.scores[:, 0] = 0.0  # only the first beam is live at the start: no duplicate hypotheses
        self.bidx = torch.full((batch, beams, max_length - prompt_len), -1, dtype=torch.long, device=device)
        self.fin_seqs = self.seqs.clone()
        self.fin_scores = torch.full((batch, beams), _NEG, dtype=torch.float32, device=device)
        self.fin_bidx = self.bidx.clone()
        self.fin_done = torch.zeros((batch, beams), dtype=torch.bool, device=device)
        self.can_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.top_mask = torch.arange(self.keep, device=device) < beams  # (keep,)
        self.all_hit = False
        self.hits = torch.zeros((batch, self.keep), dtype=torch.bool, device=device)

    # -- per step -----------------------------------------------------------------------------
    def running_ids(self, cur_len: int) -> torch.Tensor:
        """Running sequences as the model batch sees them: ``(batch * beams, cur_len)``."""
        return self.seqs[:, :, :cur_len].reshape(self.batch * self.beams, cur_len)

    def step(self, log_probs: torch.Tensor, cur_len: int, do_sample: bool, eos: torch.Tensor | None,
             other_criteria: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance by one token from processed ``log_probs`` ``(batch, beams, vocab)``.

        Returns ``(next_tokens, parent_rows)``, both ``(batch, beams)``: the last token of each new
        running beam and the flat model row it continues (for the cache reorder).
        """
        batch, beams = self.batch, self.beams
        vocab = log_probs.shape[-1]
        total = (log_probs + self.scores[:, :, None]).view(batch, beams * vocab)
        if do_sample:
            picked = torch.multinomial(torch.softmax(total, dim=-1), num_samples=self.keep)
            cand_scores = total.gather(1, picked)
        else:
            cand_scores, picked = torch.topk(total, self.keep, dim=1)
        parent = picked // vocab  # (batch, keep) beam within this tracker
        tokens = picked % vocab
        cand_seqs = self.seqs.gather(1, parent[:, :, None].expand(-1, -1, self.max_length))
        cand_seqs[:, :, cur_len] = tokens
        parent_rows = parent + self.row_base
        cand_bidx = self.bidx.gather(1, parent[:, :, None].expand(-1, -1, self.bidx.shape[-1]))
        cand_bidx[:, :, cur_len - self.prompt_len] = parent_rows

        # which candidates are finished
        if cur_len + 1 >= self.max_length:
            hits = torch.ones_like(tokens, dtype=torch.bool)
        elif eos is not None:
            hits = torch.isin(tokens, eos)
        else:
            hits = torch.zeros_like(tokens, dtype=torch.bool)
        if other_criteria:
            flat = cand_seqs[:, :, :cur_len + 1].reshape(batch * self.keep, cur_len + 1)
            hits = hits | StoppingCriteriaList(other_criteria)(flat, None).view(batch, self.keep)
        self.all_hit = cur_len + 1 >= self.max_length
        self.hits = hits

        # next running beams: the best candidates that are not finished
        live_scores = cand_scores + hits.to(torch.float32) * _NEG
        order = torch.topk(live_scores, beams, dim=1).indices
        self.seqs = cand_seqs.gather(1, order[:, :, None].expand(-1, -1, self.max_length))
        self.scores = live_scores.gather(1, order)
        self.bidx = cand_bidx.gather(1, order[:, :, None].expand(-1, -1, self.bidx.shape[-1]))

        # finished set: merge the candidates that just finished among the top `beams`
        self._merge_finished(cand_seqs, cand_scores, cand_bidx, hits & self.top_mask[None, :], cur_len)
        return tokens.gather(1, order), parent_rows.gather(1, order)

    def _merge_finished(self, cand_seqs: torch.Tensor, cand_scores: torch.Tensor, cand_bidx: torch.Tensor,
                        just_finished: torch.Tensor, cur_len: int) -> None:
        normed = cand_scores / float(cur_len + 1 - self.prompt_len) ** self.length_penalty
        allowed = just_finished & self.can_improve
        if self.early_stopping is True:
            allowed = allowed & ~self.fin_done.all(dim=1, keepdim=True)
        normed = torch.where(allowed, normed, torch.full_like(normed, _NEG))
        all_scores = torch.cat((self.fin_scores, normed), dim=1)
        best = torch.topk(all_scores, self.beams, dim=1).indices
        self.fin_scores = all_scores.gather(1, best)
        idx3 = best[:, :, None]
        self.fin_seqs = torch.cat((self.fin_seqs, cand_seqs), 1).gather(1, idx3.expand(-1, -1, self.max_length))
        self.fin_bidx = torch.cat((self.fin_bidx, cand_bidx), 1).gather(1, idx3.expand(-1, -1, self.bidx.shape[-1]))
        self.fin_done = torch.cat((self.fin_done, allowed), 1).gather(1, best)

    def update_stop(self, new_len: int) -> None:
        """After a step (``new_len`` = tokens now in the sequences): can running beams still win?"""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = new_len - self.prompt_len
        best_running = self.scores[:, :1] / float(best_len) ** self.length_penalty
        worst_finished = torch.where(self.fin_done, self.fin_scores.min(dim=1, keepdim=True).values,
                                     torch.full_like(self.fin_scores, _NEG))
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


def output_fill_value(config: Any, eos: torch.Tensor | None) -> int:
    """Token written after a finished hypothesis: transformers' choice (the pad id when it is set and
    non-zero, else the first EOS id), so padded outputs compare equal."""
    pad = config.pad_token_id
    if eos is not None and eos.numel():
        return int(pad) if pad else int(eos.view(-1)[0])
    return int(pad) if pad is not None else 0


def check_no_streamer(streamer: Any, name: str) -> None:
    if streamer is not None:
        raise ValueError(
            f"`streamer` cannot be used with {name} (num_beams > 1): the best hypothesis is only known at the "
            "end. Use num_beams=1 (greedy search or sampling) to stream, or drop the streamer."
        )


class BeamRunner:
    """Model calls shared by the beam strategies: prefill once per prompt, expand the cache to the
    beams, then one single-token forward per step with the cache reordered to the surviving beams."""

    def __init__(self, model: Any, input_ids: torch.Tensor, beams: int, max_length: int, *,
                 attention_mask: torch.Tensor | None, past_key_values: Any, use_cache: bool,
                 position_ids: torch.Tensor | None, want_hidden: bool) -> None:
        self.model = model
        self.beams = beams
        self.want_hidden = want_hidden
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        padded = attention_mask is not None and not bool(attention_mask.all())
        self.mask_buf: torch.Tensor | None = None
        self.next_pos: torch.Tensor | None = None
        if padded:
            assert attention_mask is not None
            self.mask_buf = torch.ones((batch * beams, max_length), dtype=attention_mask.dtype, device=device)
            self.mask_buf[:, :prompt_len] = attention_mask.repeat_interleave(beams, dim=0)
            self.next_pos = attention_mask.sum(-1, keepdim=True).repeat_interleave(beams, dim=0)
        cache = past_key_values
        if cache is None and use_cache and hasattr(model, "new_cache"):
            cache = model.new_cache(max_length)
        self.use_cache = use_cache
        out = model(input_ids, attention_mask=attention_mask if padded else None, position_ids=position_ids,
                    past_key_values=cache, use_cache=use_cache, output_hidden_states=want_hidden,
                    logits_to_keep=1)
        if use_cache:
            cache = out.past_key_values if out.past_key_values is not None else cache
            _cache_call(cache, ("repeat_interleave", "batch_repeat_interleave"), beams)
        self.cache = cache
        self.first_logits = out.logits[:, -1, :].to(dtype=torch.float32).repeat_interleave(beams, dim=0)
        self.first_hidden = None
        if want_hidden and out.hidden_states is not None:
            self.first_hidden = tuple(h.repeat_interleave(beams, dim=0) for h in out.hidden_states)

    def next_logits(self, seqs_flat: torch.Tensor, parent_rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Reorder the cache to ``parent_rows`` (flat) and run the new last tokens of ``seqs_flat``."""
        cur = seqs_flat.shape[1]
        if self.use_cache:
            _cache_call(self.cache, ("reorder", "reorder_cache"), parent_rows)
            pos = None
            if self.next_pos is not None:
                pos = self.next_pos
                self.next_pos = self.next_pos + 1
            out = self.model(seqs_flat[:, -1:], attention_mask=self.mask_buf[:, :cur] if self.mask_buf is not None
                             else None, position_ids=pos, past_key_values=self.cache, use_cache=True,
                             output_hidden_states=self.want_hidden, logits_to_keep=1)
        else:
            out = self.model(seqs_flat, attention_mask=self.mask_buf[:, :cur] if self.mask_buf is not None else None,
                             use_cache=False, output_hidden_states=self.want_hidden, logits_to_keep=1)
        return out.logits[:, -1, :].to(dtype=torch.float32), out.hidden_states if self.want_hidden else None


def _cache_call(cache: Any, names: tuple[str, ...], arg: Any) -> None:
    for name in names:
        fn = getattr(cache, name, None)
        if fn is not None:
            fn(arg)
            return
    raise ValueError(
        f"beam search needs a cache with {' or '.join(names)}(); {type(cache).__name__} has none. "
        "Pass use_cache=False to run without a cache."
    )


def beam_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Beam search: keep the ``num_beams`` best-scoring hypotheses at every step."""
    return beam_decode(model, input_ids, do_sample=False, **kwargs)


def beam_sample(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateBeamDecoderOnlyOutput:
    """Beam-search multinomial sampling: draw the kept continuations from the softmax of the
    accumulated scores (without replacement) instead of taking the top ones."""
    return beam_decode(model, input_ids, do_sample=True, **kwargs)


def beam_decode(
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
) -> GenerateBeamDecoderOnlyOutput:
    """The beam loop behind ``beam_search`` and ``beam_sample``; ``input_ids`` is ``(batch, prompt)``
    (not yet expanded to the beams)."""
    name = "beam sampling" if do_sample else "beam search"
    check_no_streamer(streamer, name)
    if unused:
        raise ValueError(f"unexpected model inputs for {name}: {sorted(unused)}")
    cfg = generation_config
    beams = int(cfg.num_beams)
    if beams < 1:
        raise ValueError(f"`num_beams` must be >= 1 for {name}; got {beams}")
    n_return = int(cfg.num_return_sequences)
    if n_return > beams:
        raise ValueError(f"`num_return_sequences` ({n_return}) must be <= `num_beams` ({beams}).")
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    max_length = stopping_criteria.max_length or cfg.max_length
    others, eos = _split_criteria(stopping_criteria)
    if eos is not None:
        eos = eos.to(device)
    use_cache = bool(use_cache and cfg.use_cache)

    tracker = BeamTracker(input_ids, beams, max_length, output_fill_value(cfg, eos), 0 if eos is None else eos.numel(),
                          cfg.length_penalty, cfg.early_stopping,
                          torch.arange(batch, device=device) * beams)
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
        log_probs = torch.log_softmax(logits, dim=-1)
        log_probs = logits_processor(tracker.running_ids(cur), log_probs)
        if want_scores:
            scores_out.append(log_probs.clone())
        _, parents = tracker.step(log_probs.view(batch, beams, -1), cur, do_sample, eos, others)
        cur += 1
        tracker.update_stop(cur)
        if tracker.all_hit or not bool(tracker.open_flag()):
            break
        logits, hidden = runner.next_logits(tracker.running_ids(cur), parents.view(-1))

    seqs, seq_scores, bidx = tracker.finished()
    return build_output(seqs, seq_scores, bidx, n_return, prompt_len, cfg, scores_out, logits_out, hidden_out,
                        runner.cache if use_cache else None)


def build_output(seqs: torch.Tensor, seq_scores: torch.Tensor, bidx: torch.Tensor, n_return: int, prompt_len: int,
                 cfg: Any, scores_out: list[torch.Tensor], logits_out: list[torch.Tensor], hidden_out: list[Any],
                 cache: Any) -> GenerateBeamDecoderOnlyOutput:
    """Best ``n_return`` hypotheses per prompt, cropped to the longest generated length."""
    seqs = seqs[:, :n_return].reshape(-1, seqs.shape[-1])
    seq_scores = seq_scores[:, :n_return].reshape(-1)
    bidx = bidx[:, :n_return].reshape(-1, bidx.shape[-1])
    gen_len = int((bidx >= 0).sum(dim=1).max()) if bidx.numel() else 0
    return GenerateBeamDecoderOnlyOutput(
        sequences=seqs[:, :prompt_len + gen_len],
        sequences_scores=seq_scores if cfg.output_scores else None,
        scores=tuple(scores_out) if cfg.output_scores else None,
        logits=tuple(logits_out) if cfg.output_logits else None,
        beam_indices=bidx[:, :gen_len],
        hidden_states=tuple(hidden_out) if cfg.output_hidden_states else None,
        past_key_values=cache,
    )
