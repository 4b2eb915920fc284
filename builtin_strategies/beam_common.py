"""What the beam strategies share: beam search and beam sampling (``beam_search.py``), diverse beam
search (``beam_diverse.py``) and constrained beam search (``beam_constraints.py``).

* :class:`BeamRun` holds one run, built on :mod:`genkit.strategy`: the strategy call, a
  :class:`~genkit.strategy.Stepper` that runs the prompt once per prompt, expands the cache to the
  beams and then runs one token per beam per step with the cache following the surviving beams
  (``step(tokens, rows=parents)``), a :class:`~genkit.strategy.FinishTracker` that tells which
  candidates end (max length, EOS, the other stopping criteria), the per-step outputs the config
  asks for, and the output at the end (best ``num_return_sequences`` hypotheses per prompt,
  cropped to the longest generated length);
* :func:`extend` builds the candidates of a step (a beam plus one token);
* :func:`take` gathers whole hypotheses (sequences, beam indices) along the beam dimension.

Hypotheses are tensors of shape ``(batch, beams, ...)``; beam indices are recorded as flat model
rows, the convention of ``compute_transition_scores``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from genkit.strategy import (
    ConfigError,
    FinishTracker,
    GenerateBeamDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    check_choosable,
)

NEG = -1.0e9  # score given to slots that must not be chosen (finite, so sums stay ordered)
# float32's largest finite value and smallest normal one: the range of a length normalizer
_F32_MAX, _F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def check_beam_choice(log_probs: torch.Tensor, batch: int) -> torch.Tensor:
    """Raise where the processed ``log_probs`` ``(batch * beams, vocab)`` of a prompt's beams rule out
    every candidate (every score ``-inf``: contradicting constraints) or are NaN, as the sampler
    does for one row (:func:`~genkit.strategy.check_choosable`); ``log_probs`` otherwise."""
    flat = log_probs.reshape(batch, -1)
    check_choosable(flat, flat.argmax(dim=-1))
    return log_probs


def length_normalizer(length: int, length_penalty: float) -> float:
    """``length ** length_penalty``, what a hypothesis' summed log-probabilities are divided by:
    transformers' value wherever it is a float32 (scores are float32), else the nearest end of that
    range. transformers computes it as a Python float, which a large ``length_penalty`` (1e308)
    overflows (an OverflowError) or takes past float32 (its scores become -0.0, or NaN for -inf);
    kept within the range, no division gives NaN and the order of scores is kept."""
    try:
        value = math.pow(length, length_penalty)  # (as float(length) ** length_penalty)
    except OverflowError:
        value = _F32_MAX
    return min(max(value, _F32_TINY), _F32_MAX)


def output_fill_value(config: Any, eos: torch.Tensor | None) -> int:
    """Token written after a finished hypothesis: transformers' choice (the pad id when it is set and
    non-zero, else the first EOS id; -1 without EOS ids, where only other stopping criteria end a
    hypothesis early), so padded outputs compare equal."""
    if eos is None or not eos.numel():
        return -1
    pad = config.pad_token_id
    return int(pad) if pad else int(eos.view(-1)[0])


def beam_call(name: str, model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> StrategyCall:
    """Read the call of the beam strategy ``name``: no streamer, no unknown model inputs."""
    if kwargs.get("streamer") is not None:
        raise ConfigError(
            f"`streamer` cannot be used with {name} (num_beams > 1): the best hypothesis is only known at the "
            "end. Use num_beams=1 (greedy search or sampling) to stream, or drop the streamer."
        )
    return StrategyCall.from_kwargs(name, model, input_ids, **kwargs)


def sequence_buffer(prompt: torch.Tensor, max_length: int, fill_value: int, beams: int) -> torch.Tensor:
    """Hypothesis buffer ``(batch, beams, max_length)`` with the prompt ``(batch, prompt_len)`` in every beam."""
    batch, prompt_len = prompt.shape
    seqs = torch.full((batch, beams, max_length), fill_value, dtype=torch.long, device=prompt.device)
    seqs[..., :prompt_len] = prompt[:, None, :]
    return seqs


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


class BeamRun:
    """One run of a beam strategy with ``beams`` beams per prompt, after its own checks: runs the
    prompt through the model, then one forward per step, keeping what the config asks for, and
    builds the output."""

    def __init__(self, call: StrategyCall, beams: int) -> None:
        cfg = call.config
        self.n_return = int(cfg.num_return_sequences)
        if self.n_return > beams:
            raise ConfigError(f"`num_return_sequences` ({self.n_return}) must be <= `num_beams` ({beams}).")
        self.call, self.config, self.beams = call, cfg, beams
        eos = call.stop.eos
        self.fill = output_fill_value(cfg, eos)
        self.n_eos = 0 if eos is None else eos.numel()
        self.outputs = StepOutputs(cfg)
        self.finish = FinishTracker(call, rows=call.batch * beams)
        self.stepper = Stepper(call, rows_per_prompt=beams, output_hidden_states=self.outputs.want_hidden)
        self.logits = self.stepper.prefill()
        self.hidden = self.stepper.hidden_states

    def log_probs(self) -> torch.Tensor:
        """``log_softmax`` of the last forward's logits ``(batch * beams, vocab)``, after keeping
        the raw logits and hidden states the config asks for."""
        self.outputs.model_step(self.logits, self.hidden, self.stepper.attentions)
        return torch.log_softmax(self.logits, dim=-1)

    def hits(self, tokens: torch.Tensor, cand_seqs: torch.Tensor, cur_len: int) -> torch.Tensor:
        """Which candidates end with their new token ``tokens`` (at ``cur_len`` in ``cand_seqs``)."""
        return self.finish.hits(tokens, cand_seqs[..., :cur_len + 1])

    def ends(self, tokens: torch.Tensor, cand_seqs: torch.Tensor, cur_len: int) -> torch.Tensor:
        """:meth:`hits` but for reaching ``max_length``: candidates that end by an EOS token or a
        stopping criterion (transformers 4.x's ``BeamSearchScorer`` kept the others running to the
        last step and added them to the finished hypotheses at the end)."""
        return self.finish.hits(tokens, cand_seqs[..., :cur_len + 1], count_length=False)

    def forward(self, tokens: torch.Tensor, parent_rows: torch.Tensor) -> None:
        """Next step's forward: each row continues flat row ``parent_rows[i]`` with ``tokens[i]``."""
        self.logits = self.stepper.step(tokens.reshape(-1), rows=parent_rows.reshape(-1))
        self.hidden = self.stepper.hidden_states

    def output(self, seqs: torch.Tensor, seq_scores: torch.Tensor, bidx: torch.Tensor) -> GenerateBeamDecoderOnlyOutput:
        """Best ``num_return_sequences`` hypotheses per prompt (``(batch, beams, ...)``, best first),
        cropped to the longest generated length."""
        n_return = self.n_return
        seqs = seqs[:, :n_return].reshape(-1, seqs.shape[-1])
        seq_scores = seq_scores[:, :n_return].reshape(-1)
        bidx = bidx[:, :n_return].reshape(-1, bidx.shape[-1])
        gen_len = int((bidx >= 0).sum(dim=1).max()) if bidx.numel() else 0
        return GenerateBeamDecoderOnlyOutput(
            sequences=seqs[:, :self.call.prompt_len + gen_len],
            sequences_scores=seq_scores if self.outputs.want_scores else None,
            beam_indices=bidx[:, :gen_len],
            past_key_values=self.stepper.cache,
            **self.outputs.as_tuples(),
        )
