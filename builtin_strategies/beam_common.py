"""What the beam strategies share: beam search and beam sampling (``beam_search.py``), diverse beam
search (``beam_diverse.py``) and constrained beam search (``beam_constraints.py``).

* :class:`BeamRun` holds one run: the strategy call read once, the model calls
  (:class:`BeamRunner`: prefill once per prompt, expand the cache to the beams, then one
  single-token forward per step with the cache reordered to the surviving beams), the per-step
  outputs the config asks for, and the output at the end (best ``num_return_sequences``
  hypotheses per prompt, cropped to the longest generated length);
* :func:`extend` and :func:`candidate_hits` build the candidates of a step (a beam plus one token)
  and tell which of them end there (max length, EOS, the other stopping criteria);
* :func:`take` gathers whole hypotheses (sequences, beam indices) along the beam dimension.

Hypotheses are tensors of shape ``(batch, beams, ...)``; beam indices are recorded as flat model
rows, the convention of ``compute_transition_scores``.
"""

from __future__ import annotations

from typing import Any

import torch

from genkit.generation.outputs import GenerateBeamDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

from .loop_state import LoopInputs, StepOutputs, mask_buffer, open_cache, read_inputs, uncached_prompt

NEG = -1.0e9  # score given to slots that must not be chosen (finite, so sums stay ordered)


def output_fill_value(config: Any, eos: torch.Tensor | None) -> int:
    """Token written after a finished hypothesis: transformers' choice (the pad id when it is set and
    non-zero, else the first EOS id; -1 without EOS ids, where only other stopping criteria end a
    hypothesis early), so padded outputs compare equal."""
    if eos is None or not eos.numel():
        return -1
    pad = config.pad_token_id
    return int(pad) if pad else int(eos.view(-1)[0])


def check_no_streamer(streamer: Any, name: str) -> None:
    if streamer is not None:
        raise ValueError(
            f"`streamer` cannot be used with {name} (num_beams > 1): the best hypothesis is only known at the "
            "end. Use num_beams=1 (greedy search or sampling) to stream, or drop the streamer."
        )


def beam_inputs(name: str, model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> LoopInputs:
    """Read the call of the beam strategy ``name``: no streamer, no unknown model inputs."""
    check_no_streamer(kwargs.get("streamer"), name)
    return read_inputs(name, model, input_ids, **kwargs)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``(batch, n, L)`` at the hypotheses ``index`` ``(batch, k)``: ``(batch, k, L)``."""
    return x.gather(1, index[:, :, None].expand(-1, -1, x.shape[-1]))


def extend(seqs: torch.Tensor, bidx: torch.Tensor, parent: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
           cur_len: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates ``(batch, k)``: beam ``parent`` of ``seqs`` ``(batch, beams, max_length)`` followed by
    ``tokens`` at ``cur_len``; their beam indices ``bidx`` with model row ``rows`` recorded for this step."""
    cand_seqs = take(seqs, parent)
    cand_seqs[:, :, cur_len] = tokens
    cand_bidx = take(bidx, parent)
    cand_bidx[:, :, cur_len - prompt_len] = rows
    return cand_seqs, cand_bidx


def candidate_hits(tokens: torch.Tensor, cand_seqs: torch.Tensor, cur_len: int, max_length: int,
                   eos: torch.Tensor | None, others: list[Any]) -> torch.Tensor:
    """Which candidates end with their new token ``tokens`` (at ``cur_len`` in ``cand_seqs``
    ``(..., max_length)``): the last position, an EOS id, or another stopping criterion."""
    hits = torch.full_like(tokens, cur_len + 1 >= max_length, dtype=torch.bool)
    if eos is not None:
        hits = hits | torch.isin(tokens, eos)
    if others:
        flat = cand_seqs[..., :cur_len + 1].reshape(-1, cur_len + 1)
        hits = hits | StoppingCriteriaList(others)(flat, None).view(tokens.shape)
    return hits


class BeamRunner:
    """Model calls shared by the beam strategies: prefill once per prompt, expand the cache to the
    beams, then one single-token forward per step with the cache reordered to the surviving beams."""

    def __init__(self, model: Any, input_ids: torch.Tensor, beams: int, max_length: int, *,
                 attention_mask: torch.Tensor | None, past_key_values: Any, use_cache: bool,
                 position_ids: torch.Tensor | None, want_hidden: bool) -> None:
        self.model = model
        self.beams = beams
        self.want_hidden = want_hidden
        self.mask_buf, self.next_pos = mask_buffer(attention_mask, max_length, beams)
        cache = open_cache(model, past_key_values, use_cache, max_length)
        self.use_cache = use_cache
        first_ids, first_pos = uncached_prompt(input_ids, cache if use_cache else None, position_ids)
        out = model(first_ids, attention_mask=attention_mask if self.mask_buf is not None else None,
                    position_ids=first_pos, past_key_values=cache, use_cache=use_cache,
                    output_hidden_states=want_hidden, logits_to_keep=1)
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
        mask = self.mask_buf[:, :cur] if self.mask_buf is not None else None
        if self.use_cache:
            _cache_call(self.cache, ("reorder", "reorder_cache"), parent_rows)
            pos = None
            if self.next_pos is not None:
                pos = self.next_pos
                self.next_pos = self.next_pos + 1
            out = self.model(seqs_flat[:, -1:], attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                             use_cache=True, output_hidden_states=self.want_hidden, logits_to_keep=1)
        else:
            out = self.model(seqs_flat, attention_mask=mask, use_cache=False, output_hidden_states=self.want_hidden,
                             logits_to_keep=1)
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


class BeamRun:
    """One run of a beam strategy with ``beams`` beams per prompt, after its own checks: runs the
    prompt through the model (:class:`BeamRunner`), then one forward per step, keeping what the
    config asks for, and builds the output."""

    def __init__(self, inp: LoopInputs, beams: int) -> None:
        cfg = inp.config
        self.n_return = int(cfg.num_return_sequences)
        if self.n_return > beams:
            raise ValueError(f"`num_return_sequences` ({self.n_return}) must be <= `num_beams` ({beams}).")
        self.inp, self.config, self.beams = inp, cfg, beams
        self.fill = output_fill_value(cfg, inp.eos)
        self.n_eos = 0 if inp.eos is None else inp.eos.numel()
        self.outputs = StepOutputs(cfg)
        self.runner = BeamRunner(inp.model, inp.input_ids, beams, inp.max_length, attention_mask=inp.attention_mask,
                                 past_key_values=inp.past_key_values, use_cache=inp.use_cache,
                                 position_ids=inp.position_ids, want_hidden=self.outputs.want_hidden)
        self.logits, self.hidden = self.runner.first_logits, self.runner.first_hidden

    def log_probs(self) -> torch.Tensor:
        """``log_softmax`` of the last forward's logits ``(batch * beams, vocab)``, after keeping
        the raw logits and hidden states the config asks for."""
        self.outputs.model_step(self.logits, self.hidden)
        return torch.log_softmax(self.logits, dim=-1)

    def forward(self, seqs_flat: torch.Tensor, parent_rows: torch.Tensor) -> None:
        """Next step's forward: the cache follows ``parent_rows``, the new tokens end ``seqs_flat``."""
        self.logits, self.hidden = self.runner.next_logits(seqs_flat, parent_rows)

    def output(self, seqs: torch.Tensor, seq_scores: torch.Tensor, bidx: torch.Tensor) -> GenerateBeamDecoderOnlyOutput:
        """Best ``num_return_sequences`` hypotheses per prompt (``(batch, beams, ...)``, best first),
        cropped to the longest generated length."""
        n_return = self.n_return
        seqs = seqs[:, :n_return].reshape(-1, seqs.shape[-1])
        seq_scores = seq_scores[:, :n_return].reshape(-1)
        bidx = bidx[:, :n_return].reshape(-1, bidx.shape[-1])
        gen_len = int((bidx >= 0).sum(dim=1).max()) if bidx.numel() else 0
        return GenerateBeamDecoderOnlyOutput(
            sequences=seqs[:, :self.inp.prompt_len + gen_len],
            sequences_scores=seq_scores if self.outputs.want_scores else None,
            beam_indices=bidx[:, :gen_len],
            past_key_values=self.runner.cache if self.inp.use_cache else None,
            **self.outputs.as_tuples(),
        )
