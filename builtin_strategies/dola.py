"""DoLa: Decoding by Contrasting Layers (Chuang et al., ICLR 2024).

Each step contrasts the final layer's next-token log-probabilities with those of an earlier
("premature") layer read through the LM head, and picks from their difference:

1. candidate premature layers from ``dola_layers``: ``"low"`` is ``range(start, N // 2, 2)`` and
   ``"high"`` is ``range(N // 2, N, 2)`` for an ``N``-layer model (``range(start, 20, 2)`` and
   ``range(N - 20, N, 2)`` above 40 layers), where ``start`` skips the word embeddings (layer 0)
   when they are tied to the LM head (2, or 1 for a 2-layer model); a list names layers itself
   (0 = the embeddings, ``N - 1`` = the input of the last layer);
2. with several candidates, the one whose distribution is furthest from the final layer's
   (Jensen-Shannon divergence, averaged over the batch) is the premature layer;
3. tokens whose final-layer probability is below a tenth of the most likely one's are dropped; the
   rest score ``log p_final - log p_premature``;
4. the logits processors (``repetition_penalty=1.2`` is recommended) and greedy or sampled choice.

As in transformers 4.x's native implementation, whose outputs the tests compare with token for
token, a premature layer's hidden state goes through the LM head as it is (no final norm).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from genkit.strategy import (
    ConfigError,
    FinishTracker,
    GenerateDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    choose_tokens,
)

__all__ = ["Workspace", "candidate_layers", "contrast", "dola_decoding"]


def dola_decoding(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """DoLa decoding with the config's ``dola_layers`` (greedy, or sampling with ``do_sample``)."""
    call = StrategyCall.from_kwargs("DoLa decoding", model, input_ids, **kwargs)
    layers = candidate_layers(call.config.dola_layers, model)
    head = model.get_output_embeddings()
    project = getattr(model, "output_logits", None)
    do_sample = bool(call.config.do_sample)
    record = StepOutputs(call.config)
    workspace = Workspace()
    stepper = Stepper(call, output_hidden_states=True)
    with FinishTracker(call) as finish:
        logits: torch.Tensor | None = stepper.prefill()
        while True:
            hidden = stepper.hidden_states
            assert hidden is not None
            rows = [hidden[i][:, -1, :] for i in layers]
            if logits is None:  # the final layer's logits come in the same product (native models)
                rows.append(hidden[-1][:, -1, :])
            stacked = torch.stack(rows)
            # (layers, rows, vocab): one product reads the head's weights once for every layer; a
            # native model's output_logits uses its packed head
            premature = project(stacked, stepper.cache) if project is not None else head(stacked)
            if logits is None:
                logits, premature = premature[-1].float(), premature[:-1]
            record.model_step(logits, hidden, stepper.attentions)
            scores = call.logits_processor(stepper.sequences, contrast(layers, premature, logits, workspace))
            record.processed(scores)
            tokens = finish.pad(choose_tokens(scores, do_sample, live=finish.unfinished))
            stepper.push(tokens)
            if finish.update(stepper.sequences, scores, tokens):
                break
            if project is not None:  # the final hidden state is the normed one the head reads
                stepper.advance()
                logits = None
            else:
                logits = stepper.forward()
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, past_key_values=stepper.cache,
                                     finish_reasons=finish.reasons, **record.as_tuples())


def candidate_layers(dola_layers: Any, model: Any) -> list[int]:
    """The premature layers ``dola_layers`` means for ``model`` (see the module docstring)."""
    total = int(model.config.num_hidden_layers)
    if isinstance(dola_layers, list):
        bad = [i for i in dola_layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total]
        if bad or not dola_layers:
            what = f"names {bad}" if bad else "is empty"
            raise ConfigError(
                f"`dola_layers` {what}: this model has {total} layers, so premature layers are 0 (the word "
                f"embeddings) to {total - 1}; {total} is the final layer DoLa contrasts them with. Accepted: "
                '"low", "high", or a non-empty list of those indices')
        return list(dola_layers)
    if dola_layers not in ("low", "high"):
        raise ConfigError(f'`dola_layers` must be "low", "high" or a list of layer indices; got {dola_layers!r}')
    if not _tied(model):
        start = 0
    else:  # the embeddings read through their own transpose say nothing: skip them
        start = 2 if total > 2 else (1 if total == 2 else 0)
    if dola_layers == "low":
        if start == total // 2:
            return [start]
        return list(range(start, total // 2, 2)) if total <= 40 else list(range(start, 20, 2))
    return list(range(total // 2, total, 2)) if total <= 40 else list(range(total - 20, total, 2))


def _tied(model: Any) -> bool:
    """Whether the LM head is the word embedding matrix (the config's flag, else the weights themselves:
    the modules' own parameters, not ``.weight``, which a quantized layer de-quantizes on each read,
    genkit.models.quant_weight: a new tensor, never the embedding's)."""
    flag = getattr(model.config, "tie_word_embeddings", None)
    if flag is not None:
        return bool(flag)
    head = getattr(model.get_output_embeddings(), "_parameters", {}).get("weight")
    return head is not None and head is getattr(model.get_input_embeddings(), "_parameters", {}).get("weight")


def contrast(layers: list[int], premature: torch.Tensor, final: torch.Tensor,
             workspace: Workspace | None = None) -> torch.Tensor:
    """Next-token scores ``(rows, vocab)`` from the final logits and the premature layers' logits
    ``(len(layers), rows, vocab)``. A :class:`Workspace` kept across steps saves allocating the
    vocabulary-sized buffers each step."""
    if len(layers) == 1:
        return _relative_top_difference(final, premature[0])
    chosen = (workspace or Workspace()).divergence(premature, final).argmax()
    return _relative_top_difference(final, premature[int(chosen.item())])


class Workspace:
    """Three ``(layers, rows, vocab)`` buffers for the Jensen-Shannon scores, reused step after step.

    Fresh buffers of this size (1.5 MB for 8 layers of a 49K vocabulary) come from the system
    each step, and touching their pages cost more than the arithmetic (~7 of 11 ms a step on a CPU)."""

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, ...] = ()

    def _take(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        held = self._buffers
        if not held or held[0].shape != like.shape or held[0].dtype != like.dtype or held[0].device != like.device:
            held = self._buffers = tuple(torch.empty_like(like) for _ in range(3))
        return held

    def divergence(self, premature: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """transformers' Jensen-Shannon score per premature layer ``(layers,)``, averaged over the rows:
        the mean over the vocabulary of ``kl_div(log p, m)`` for ``p`` = the final and the premature
        distribution, ``kl_div(x, m) = m * (log m - x)``, ``m`` their average."""
        early, average, terms = self._take(premature)
        # probabilities under e**-87 (~1.6e-38) are taken as that: below it float32 goes subnormal,
        # which the CPU computes some 30x slower (a premature layer's logits span a wide range), and
        # the terms they change are ~1e-36 each
        # the premature log-probabilities, in `early`
        torch.sub(premature, premature.amax(dim=-1, keepdim=True), out=early)
        torch.clamp(early, min=_FLOOR, out=average).exp_()
        early.sub_(average.sum(dim=-1, keepdim=True).log_())
        final_logp = F.log_softmax(final, dim=-1)
        torch.clamp(early, min=_FLOOR, out=average)
        average.exp_().add_(final_logp.clamp(min=_FLOOR).exp_()).mul_(0.5)
        early.add_(final_logp).mul_(0.5)  # the mean of the two log-probabilities
        torch.log(average, out=terms).sub_(early).mul_(average)  # average > 0
        return terms.mean(dim=-1).mean(dim=-1)


_FLOOR = -87.0  # the smallest log-probability whose exp is a normal float32


def _relative_top_difference(final: torch.Tensor, base: torch.Tensor, relative_top: float = 0.1) -> torch.Tensor:
    """``log p_final - log p_base`` over the tokens whose final probability is at least
    ``relative_top`` times the highest; ``-inf`` elsewhere."""
    final_logp = final.log_softmax(dim=-1)
    base_logp = base.log_softmax(dim=-1)
    threshold = (final_logp.max(dim=-1).values + math.log(relative_top)).unsqueeze(-1)
    dropped = final_logp < threshold
    base_logp.masked_fill_(dropped, -1e-3)
    return final_logp.masked_fill_(dropped, -float("inf")).sub_(base_logp)
