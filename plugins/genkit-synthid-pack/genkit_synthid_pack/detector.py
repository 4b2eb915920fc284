"""Detecting the SynthID text watermark.

Every detector looks at the g-values of a text (``processor.compute_g_values``) where the
watermark could have acted: positions whose context was not repeated and that come before the
first EOS token (the *mask*). Unwatermarked text has g-values that are fair coin flips (mean 0.5);
watermarked text has more ones.

- :func:`mean_score` and :func:`weighted_mean_score`: the paper's scores, which need no training
  (higher means watermarked; compare with a threshold set on text you know is not watermarked).
- :class:`BayesianDetectorModel`: the paper's Bayesian detector (transformers'
  ``BayesianDetectorModel``, same parameters, so a ``state_dict`` trained with transformers' script
  loads into it): the posterior probability that a text is watermarked. It must be trained.
- :class:`SynthIDTextWatermarkDetector`: transformers' wrapper that computes g-values and mask of
  token ids and hands them to a detector: a :class:`BayesianDetectorModel` as in transformers, or
  any ``(g_values, mask) -> scores`` callable such as :func:`mean_score`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from genkit.errors import ConfigError

from .config import SynthIDTextWatermarkingConfig

logger = logging.getLogger("genkit_synthid_pack")

__all__ = ["BayesianDetectorConfig", "BayesianDetectorModel", "BayesianWatermarkDetectorModelOutput",
           "SynthIDTextWatermarkDetector", "mean_score", "weighted_mean_score"]


def _check(g_values: torch.Tensor, mask: torch.Tensor) -> None:
    if g_values.dim() != 3:
        raise ConfigError(f"`g_values` must have the shape (batch, length, depth); got {tuple(g_values.shape)}")
    if tuple(mask.shape) != tuple(g_values.shape[:2]):
        raise ConfigError(f"`mask` must have the shape (batch, length) = {tuple(g_values.shape[:2])}; got "
                          f"{tuple(mask.shape)}")


def mean_score(g_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the unmasked g-values of each row, over positions and layers: ``(batch,)``.
    About 0.5 for unwatermarked text, higher for watermarked text (a row with nothing unmasked is NaN)."""
    _check(g_values, mask)
    depth = g_values.shape[-1]
    mask = mask.to(torch.float64)
    total = (g_values.to(torch.float64) * mask[:, :, None]).sum(dim=(1, 2))
    return total / (depth * mask.sum(dim=1))


def weighted_mean_score(g_values: torch.Tensor, mask: torch.Tensor,
                        weights: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mean_score` with one weight per layer: ``(batch,)``. The first layers of the tournament
    carry more signal, so the default weights fall linearly from 10 to 1; weights are normalised to
    sum to the depth, so the score of unwatermarked text stays about 0.5."""
    _check(g_values, mask)
    depth = g_values.shape[-1]
    if weights is None:
        weights = torch.linspace(10, 1, depth, dtype=torch.float64)
    weights = torch.as_tensor(weights, dtype=torch.float64, device=g_values.device)
    if tuple(weights.shape) != (depth,) or bool((weights < 0).any()) or not float(weights.sum()) > 0:
        raise ConfigError(f"`weights` must be {depth} non-negative numbers (one per layer) with a positive sum; "
                          f"got {weights.tolist()}")
    weights = weights * (depth / weights.sum())
    mask = mask.to(torch.float64)
    total = (g_values.to(torch.float64) * weights * mask[:, :, None]).sum(dim=(1, 2))
    return total / (depth * mask.sum(dim=1))


# -- the Bayesian detector (transformers' BayesianDetectorModel) ----------------------------------

@dataclass
class BayesianDetectorConfig:
    """transformers' ``BayesianDetectorConfig``: the number of tournament layers and the prior
    probability that a text is watermarked; ``model_name`` and ``watermarking_config`` record what
    the detector was trained for."""

    watermarking_depth: int | None = None
    base_rate: float = 0.5
    model_name: str | None = None
    watermarking_config: dict[str, Any] | None = None

    def set_detector_information(self, model_name: str, watermarking_config: Any) -> None:
        self.model_name = model_name
        self.watermarking_config = watermarking_config


@dataclass
class BayesianWatermarkDetectorModelOutput:
    """``loss`` (when ``labels`` were given) and ``posterior_probabilities`` ``(batch,)``."""

    loss: torch.Tensor | None = None
    posterior_probabilities: torch.Tensor | None = None


class BayesianDetectorWatermarkedLikelihood(nn.Module):
    """P(g-values | watermarked) for binary g-values: a logistic model, per layer, of whether the
    tournament match had two distinct tokens, given the g-values of the layers before it."""

    def __init__(self, watermarking_depth: int) -> None:
        super().__init__()
        self.watermarking_depth = watermarking_depth
        self.beta = nn.Parameter(-2.5 + 0.001 * torch.randn(1, 1, watermarking_depth))
        self.delta = nn.Parameter(0.001 * torch.randn(1, 1, watermarking_depth, watermarking_depth))

    def _compute_latents(self, g_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.repeat_interleave(torch.unsqueeze(g_values, dim=-2), self.watermarking_depth, dim=-2)
        x = torch.tril(x, diagonal=-1)  # layer l sees only the layers before it
        logits = (self.delta[..., None, :] @ x.type(self.delta.dtype)[..., None]).squeeze() + self.beta
        p_two_unique_tokens = torch.sigmoid(logits)
        return 1 - p_two_unique_tokens, p_two_unique_tokens

    def forward(self, g_values: torch.Tensor) -> torch.Tensor:
        p_one, p_two = self._compute_latents(g_values)
        return 0.5 * ((g_values + 0.5) * p_two + p_one)


class BayesianDetectorModel(nn.Module):
    """The Bayesian detector of the SynthID paper (transformers' ``BayesianDetectorModel``): the
    posterior P(watermarked | g-values), with unwatermarked g-values modelled as fair coin flips.

    The parameters have transformers' names (``likelihood_model_watermarked.beta``,
    ``likelihood_model_watermarked.delta``, ``prior``), so ``load_state_dict`` takes the weights of a
    detector trained with transformers. An untrained detector (random initialisation) gives
    meaningless posteriors: train it on g-values of watermarked and unwatermarked text (``labels``
    gives the loss transformers' training script minimises).
    """

    def __init__(self, config: BayesianDetectorConfig) -> None:
        super().__init__()
        if not isinstance(config.watermarking_depth, int) or config.watermarking_depth < 1:
            raise ConfigError(f"`watermarking_depth` must be an int >= 1 (the number of keys); got "
                              f"{config.watermarking_depth!r}")
        if not 0 < config.base_rate < 1:
            raise ConfigError(f"`base_rate` must be a number in (0, 1); got {config.base_rate!r}")
        self.config = config
        self.watermarking_depth = config.watermarking_depth
        self.base_rate = config.base_rate
        self.likelihood_model_watermarked = BayesianDetectorWatermarkedLikelihood(config.watermarking_depth)
        self.prior = nn.Parameter(torch.tensor([config.base_rate]))

    @staticmethod
    def _compute_posterior(likelihoods_watermarked: torch.Tensor, likelihoods_unwatermarked: torch.Tensor,
                           mask: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        mask = torch.unsqueeze(mask, dim=-1)
        prior = torch.clamp(prior, min=1e-5, max=1 - 1e-5)
        log_w = torch.log(torch.clamp(likelihoods_watermarked, min=1e-30, max=float("inf")))
        log_u = torch.log(torch.clamp(likelihoods_unwatermarked, min=1e-30, max=float("inf")))
        surprisal = torch.einsum("i...->i", (log_w - log_u) * mask)
        return torch.sigmoid(torch.log(prior) - torch.log(1 - prior) + surprisal)

    def forward(self, g_values: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None = None,
                loss_batch_weight: float = 1, return_dict: bool = False) -> Any:
        """P(watermarked | g-values) ``(batch,)`` for g-values ``(batch, length, depth)`` and a mask
        ``(batch, length)``; with ``labels`` also the training loss. A tuple, or a
        :class:`BayesianWatermarkDetectorModelOutput` with ``return_dict=True``."""
        _check(g_values, mask)
        likelihoods_watermarked = self.likelihood_model_watermarked(g_values)
        likelihoods_unwatermarked = 0.5 * torch.ones_like(g_values)
        out = self._compute_posterior(likelihoods_watermarked, likelihoods_unwatermarked, mask, self.prior)
        loss = None
        if labels is not None:
            penalty = torch.sum(self.likelihood_model_watermarked.delta ** 2) * loss_batch_weight
            loss = nn.functional.binary_cross_entropy(torch.clamp(out, 1e-5, 1 - 1e-5), labels) + penalty
        if not return_dict:
            return (out,) if loss is None else (out, loss)
        return BayesianWatermarkDetectorModelOutput(loss=loss, posterior_probabilities=out)


# -- the wrapper ---------------------------------------------------------------------------------

class SynthIDTextWatermarkDetector:
    """Scores token ids for the SynthID watermark (transformers' ``SynthIDTextWatermarkDetector``).

    Args:
        detector_module: a :class:`BayesianDetectorModel` (as in transformers), or any callable
            ``(g_values, mask) -> scores`` such as :func:`mean_score` or :func:`weighted_mean_score`.
        logits_processor: the :class:`~genkit_synthid_pack.processor.SynthIDTextWatermarkLogitsProcessor`
            of the watermark (``config.construct_processor(vocab_size, device)``), or the
            :class:`~genkit_synthid_pack.SynthIDTextWatermarkingConfig` itself.
        tokenizer: the tokenizer (its ``eos_token_id`` ends the scored part of each row), or ``None``
            to score every position.

    ``detector(ids)`` returns what ``detector_module`` returns for the g-values and mask of ``ids``
    ``(batch, length)``; :meth:`g_values_and_mask` gives those two tensors.
    """

    def __init__(self, detector_module: Any, logits_processor: Any, tokenizer: Any = None,
                 device: Any = "cpu") -> None:
        if isinstance(logits_processor, SynthIDTextWatermarkingConfig):
            logits_processor = logits_processor.construct_processor(0, device)
        if not callable(getattr(logits_processor, "compute_g_values", None)):
            raise ConfigError("`logits_processor` must be a SynthIDTextWatermarkLogitsProcessor or a "
                              f"SynthIDTextWatermarkingConfig; got {type(logits_processor).__name__}")
        if not callable(detector_module):
            raise ConfigError("`detector_module` must be a BayesianDetectorModel or a callable "
                              f"(g_values, mask) -> scores; got {detector_module!r}")
        self.detector_module = detector_module
        self.logits_processor = logits_processor
        self.tokenizer = tokenizer

    def g_values_and_mask(self, tokenized_outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The g-values ``(batch, length - (ngram_len - 1), depth)`` and the mask of the positions
        the watermark could have acted on (context not repeated, before the first EOS)."""
        proc = self.logits_processor
        if not isinstance(tokenized_outputs, torch.Tensor) or tokenized_outputs.dim() != 2:
            raise ConfigError("`tokenized_outputs` must be a 2-D tensor of token ids (batch, length)")
        if tokenized_outputs.shape[1] < proc.ngram_len:
            raise ConfigError(f"`tokenized_outputs` needs at least ngram_len={proc.ngram_len} tokens per row; got "
                              f"{tokenized_outputs.shape[1]}")
        mask = proc.compute_context_repetition_mask(tokenized_outputs)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            mask = mask & proc.compute_eos_token_mask(tokenized_outputs, eos)[:, proc.ngram_len - 1:]
        return proc.compute_g_values(tokenized_outputs), mask

    def __call__(self, tokenized_outputs: torch.Tensor) -> Any:
        g_values, mask = self.g_values_and_mask(tokenized_outputs)
        return self.detector_module(g_values, mask)
