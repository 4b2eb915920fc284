"""Contrastive search (Su et al., 2022, "A Contrastive Framework for Neural Text Generation").

Each step takes the ``top_k`` most likely next tokens as candidates, runs each through the model to
get its last hidden state, and keeps the candidate with the best score

    (1 - penalty_alpha) * p(candidate) - penalty_alpha * max cosine(hidden(candidate), hidden(earlier token))

where the maximum runs over every earlier token of the row (left padding excluded). The candidates'
forward pass already holds the next step's logits and the winner's cache entry, so a step is one
forward of ``batch * top_k`` rows. With ``low_memory=True`` the candidates run one at a time on a
``batch``-row cache instead (``top_k`` forwards of ``batch`` rows a step; same tokens). A ``top_k``
past the vocabulary names every token (its candidates are the vocabulary's; ``torch.topk`` failed).

The selection and its arithmetic follow transformers 4.x's native implementation, whose outputs the
tests compare with token for token (``tests/fixtures/make_strategy_refs.py``).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch

from genkit.config.checks import model_vocab_size
from genkit.config.resolve import contrastive_candidates
from genkit.strategy import (
    ConfigError,
    FinishTracker,
    GenerateDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    check_choosable,
)

__all__ = ["contrastive_search"]


def contrastive_search(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Contrastive search with ``penalty_alpha`` and ``top_k`` candidates (``low_memory``: one at a time)."""
    call = StrategyCall.from_kwargs("contrastive search", model, input_ids, **kwargs)
    alpha, top_k = _settings(call.config)
    top_k = contrastive_candidates(top_k, model_vocab_size(call.model))  # top_k past the vocabulary: every token
    if not call.use_cache:
        raise ConfigError("contrastive search needs the cache (it keeps the chosen candidate's entry): "
                          "`use_cache` must be True")
    if call.config.low_memory:
        return _one_candidate_at_a_time(call, alpha, top_k)
    return _all_candidates_at_once(call, alpha, top_k)


def _settings(config: Any) -> tuple[float, int]:
    """``penalty_alpha`` and ``top_k``, checked (``generate`` checks them too; a direct call may not)."""
    alpha, top_k = config.penalty_alpha, config.top_k
    if alpha is None or isinstance(alpha, bool) or not 0 <= alpha <= 1:
        raise ConfigError(f"`penalty_alpha` must be a number in [0, 1] for contrastive search; got {alpha!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 1:
        raise ConfigError(f"contrastive search needs `top_k` > 1 candidates per step; got top_k={top_k!r}")
    return float(alpha), top_k


class Degeneration:
    """The earlier tokens' last hidden states (normalised) per row, and the degeneration penalty of
    candidates against them."""

    def __init__(self, call: StrategyCall, prompt_hidden: torch.Tensor) -> None:
        rows, length, width = prompt_hidden.shape
        self.hidden = prompt_hidden.new_empty((rows, call.max_length, width))
        self.hidden[:, :length] = _unit(prompt_hidden)
        self.mask = torch.ones((rows, call.max_length), dtype=torch.bool, device=prompt_hidden.device)
        if call.attention_mask is not None:
            self.mask[:, :length] = call.attention_mask.to(self.mask.device).bool()
        self.length = length

    def append(self, hidden: torch.Tensor) -> None:
        """The chosen candidates' hidden states ``(rows, width)``."""
        self.hidden[:, self.length] = _unit(hidden)
        self.length += 1

    def choose(self, candidate_hidden: torch.Tensor, top_probs: torch.Tensor, alpha: float) -> torch.Tensor:
        """Index ``(rows,)`` of the best of ``k`` candidates: ``candidate_hidden`` ``(rows, k, width)``,
        their probabilities ``top_probs`` ``(rows, k)``."""
        n = self.length
        cosine = torch.matmul(_unit(candidate_hidden), self.hidden[:, :n].transpose(1, 2))  # (rows, k, n)
        cosine = cosine.masked_fill(~self.mask[:, None, :n], torch.finfo(cosine.dtype).min)
        penalty = cosine.max(dim=-1).values
        score = (1.0 - alpha) * top_probs - alpha * penalty
        return score.max(dim=-1).indices


def _unit(hidden: torch.Tensor) -> torch.Tensor:
    return hidden / hidden.norm(dim=-1, keepdim=True)


def _candidates(call: StrategyCall, logits: torch.Tensor, sequences: torch.Tensor, top_k: int,
                record: StepOutputs, hidden: Any, attentions: Any = None, live: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Processed scores, and the ``top_k`` candidates' probabilities and ids ``(rows, k)``
    (``hidden`` / ``attentions``: the forward's that gave ``logits``, for the output). A row of
    ``live`` rows whose processors allowed no token raises (the sampler's check)."""
    record.model_step(logits, hidden, attentions)
    scores = call.logits_processor(sequences, logits)
    record.processed(scores, copy=scores.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr())
    top_probs, top_ids = torch.softmax(scores, dim=-1).topk(top_k, dim=-1)
    check_choosable(scores, top_ids[:, 0], live)
    return scores, top_probs, top_ids


def _map_attentions(attentions: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor of ``Stepper.attentions`` (each layer's weights; an
    encoder-decoder decoder's cross-attentions, or None), as ``StepOutputs`` records them."""
    return tuple(tuple(fn(a) for a in part) if part is not None else None for part in attentions)


def _attention_rows(attentions: Any, rows: torch.Tensor) -> Any:
    """``Stepper.attentions`` of the rows ``rows``."""
    return _map_attentions(attentions, lambda a: a[rows])


def _picked(per_candidate: list[Any], batch_index: torch.Tensor, pick: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """From one tuple of tensors per candidate (each ``(rows, ...)``), each row's picked candidate's."""
    return tuple(torch.stack([c[i] for c in per_candidate], dim=1)[batch_index, pick]
                 for i in range(len(per_candidate[0])))


def _all_candidates_at_once(call: StrategyCall, alpha: float, top_k: int) -> GenerateDecoderOnlyOutput:
    """Rows ``i * top_k + j`` hold prompt ``i`` with candidate ``j``: each step continues every row of
    a prompt from its chosen candidate's row, appends the new candidates and runs them at once."""
    record = StepOutputs(call.config)
    stepper = Stepper(call, rows_per_prompt=top_k, output_hidden_states=True)
    chosen = torch.arange(call.batch, device=call.device) * top_k  # the row each prompt continues from
    batch_index = torch.arange(call.batch, device=call.device)
    with FinishTracker(call) as finish, ExitStack() as rolling:
        logits = stepper.prefill()[chosen]
        # the last step's token leaves the cache at the end (the processors see one growing history)
        rolling.enter_context(stepper.rollback(processors=False))
        hidden = stepper.hidden_states
        assert hidden is not None
        context = Degeneration(call, hidden[-1][chosen])
        step_hidden = tuple(h[chosen] for h in hidden) if record.want_hidden else None
        step_attentions = _attention_rows(stepper.attentions, chosen) if record.want_attentions else None
        rows = None
        while True:
            sequences = stepper.ids[chosen, :stepper.length]
            scores, top_probs, top_ids = _candidates(call, logits, sequences, top_k, record, step_hidden,
                                                     step_attentions, finish.unfinished)
            candidate_logits = stepper.step(top_ids.view(-1), rows=rows)
            hidden = stepper.hidden_states
            assert hidden is not None
            last = hidden[-1][:, -1, :]
            pick = context.choose(last.view(call.batch, top_k, -1), top_probs, alpha)
            chosen = batch_index * top_k + pick
            tokens = finish.pad(top_ids[batch_index, pick])
            stepper.ids[chosen, stepper.length - 1] = tokens  # finished rows read the pad token
            context.append(last[chosen])
            logits = candidate_logits[chosen]
            if record.want_hidden:
                step_hidden = tuple(h[chosen] for h in hidden)
            if record.want_attentions:
                step_attentions = _attention_rows(stepper.attentions, chosen)
            if finish.update(stepper.ids[chosen, :stepper.length], scores, tokens):
                break
            stepper.crop(stepper.length)  # (a recording sliding-window cache back to its window)
            rows = chosen.repeat_interleave(top_k)
        cache = stepper.cache
        if cache is not None:  # the chosen rows, without the last token (as after any other strategy)
            cache.select(chosen)
            cache.crop(stepper.length - 1)
    return GenerateDecoderOnlyOutput(sequences=stepper.ids[chosen, :stepper.length], past_key_values=cache,
                                     finish_reasons=finish.reasons, **record.as_tuples())


def _one_candidate_at_a_time(call: StrategyCall, alpha: float, top_k: int) -> GenerateDecoderOnlyOutput:
    """``low_memory``: one row per prompt; the candidates run one after another, each rolled back
    after its forward. The chosen token is appended without a forward of its own: the next step's
    first candidate forward runs it too."""
    record = StepOutputs(call.config)
    stepper = Stepper(call, output_hidden_states=True)
    batch_index = torch.arange(call.batch, device=call.device)
    with FinishTracker(call) as finish, ExitStack() as rolling:
        logits = stepper.prefill()
        # each candidate is rolled back after its forward (the processors see one growing history)
        rolling.enter_context(stepper.rollback(processors=False))
        hidden = stepper.hidden_states
        assert hidden is not None
        context = Degeneration(call, hidden[-1])
        step_hidden = hidden if record.want_hidden else None
        step_attentions = stepper.attentions if record.want_attentions else None
        while True:
            scores, top_probs, top_ids = _candidates(call, logits, stepper.sequences, top_k, record, step_hidden,
                                                     step_attentions, finish.unfinished)
            base = stepper.length
            outs = []
            for j in range(top_k):
                candidate_logits = stepper.step(top_ids[:, j])
                hidden = stepper.hidden_states
                assert hidden is not None
                outs.append((candidate_logits, hidden[-1][:, -1, :],
                             tuple(h[:, -1:] for h in hidden) if record.want_hidden else None,
                             _map_attentions(stepper.attentions, lambda a: a[:, :, -1:])
                             if record.want_attentions else None))
                stepper.crop(base)
            last = torch.stack([o[1] for o in outs], dim=1)  # (rows, k, width)
            pick = context.choose(last, top_probs, alpha)
            tokens = finish.pad(top_ids[batch_index, pick])
            stepper.push(tokens)
            context.append(last[batch_index, pick])
            logits = torch.stack([o[0] for o in outs], dim=1)[batch_index, pick]
            if record.want_hidden:
                step_hidden = _picked([o[2] for o in outs], batch_index, pick)
            if record.want_attentions:
                step_attentions = tuple(None if part is None else _picked([o[3][which] for o in outs], batch_index, pick)
                                        for which, part in enumerate(outs[0][3]))  # type: ignore[arg-type]
            if finish.update(stepper.sequences, scores, tokens):
                break
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, past_key_values=stepper.cache,
                                     finish_reasons=finish.reasons, **record.as_tuples())
