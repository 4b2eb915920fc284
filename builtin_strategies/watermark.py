"""The green-list watermark processor (transformers' ``WatermarkLogitsProcessor``) and its factory.

Green lists are derived exactly as transformers derives them, so a text watermarked by one is
detected by the other: a fixed table is a ``torch.randperm(1_000_003)`` seeded with the hashing
key; before each token a generator is seeded from the context (``"lefthash"``: key times the last
token; ``"selfhash"``: the smallest of key * table[t] * table[last] over the context tokens ``t``)
and the first ``greenlist_ratio`` of ``torch.randperm(vocab_size)`` are the green tokens.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from genkit.errors import ConfigError
from genkit.strategy import model_vocab_size
from genkit.strategy.processing import LogitsProcessor, ProcessorContext

logger = logging.getLogger("genkit.watermark")

__all__ = ["GreenLists", "WatermarkLogitsProcessor", "make_watermark"]

TABLE_SIZE = 1_000_003
# candidates the selfhash scheme tries per step, best first (as transformers and the paper's code)
SELFHASH_CANDIDATES = 40


class GreenLists:
    """The green lists of one watermark key: ``greenlist(context)`` and ``is_green(context, token)``.

    Membership answers are cached (``cache_size`` entries, least recently used dropped), since
    detection and the selfhash scheme ask about the same contexts again and again.
    """

    def __init__(self, vocab_size: int, device: Any, greenlist_ratio: float, hashing_key: int,
                 seeding_scheme: str, context_width: int, cache_size: int = 4096) -> None:
        self.vocab_size = int(vocab_size)
        self.greenlist_size = int(self.vocab_size * greenlist_ratio)
        self.hashing_key = int(hashing_key)
        self.seeding_scheme = seeding_scheme
        self.context_width = int(context_width)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.rng = torch.Generator(device=self.device)
        self.rng.manual_seed(self.hashing_key)
        self.fixed_table = torch.randperm(TABLE_SIZE, generator=self.rng, device=self.device)
        self._cache: OrderedDict[tuple[int, ...], bool] = OrderedDict()
        self._cache_size = cache_size

    def seed(self, context: torch.Tensor) -> int:
        """The generator seed for the last ``context_width`` tokens of ``context`` (1-D)."""
        context = context[-self.context_width:].to(self.device)
        if self.seeding_scheme == "selfhash":
            # int64 products wrap around exactly as transformers' do
            a = self.fixed_table[context % TABLE_SIZE] + 1
            b = self.fixed_table[context[-1] % TABLE_SIZE] + 1
            seed = int((self.hashing_key * a * b).min().item())
        else:
            seed = self.hashing_key * int(context[-1].item())
        return seed % (2**64 - 1)

    def greenlist(self, context: torch.Tensor) -> torch.Tensor:
        """The green token ids after ``context`` (1-D tensor of ids)."""
        self.rng.manual_seed(self.seed(context))
        perm = torch.randperm(self.vocab_size, device=self.device, generator=self.rng)
        return perm[:self.greenlist_size]

    def is_green(self, context: Any, token: int) -> bool:
        """Whether ``token`` is in the green list of ``context`` (a tuple or 1-D tensor of ids)."""
        key = (*(int(t) for t in context), int(token))
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        ids = torch.tensor(key[:-1], dtype=torch.long, device=self.device)
        hit = bool((self.greenlist(ids) == int(token)).any())
        self._cache[key] = hit
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return hit


class WatermarkLogitsProcessor(LogitsProcessor):
    """Adds ``bias`` to the green tokens' logits (transformers' ``WatermarkLogitsProcessor``, same
    arguments). Apply it after every other processor: it must see the final scores."""

    def __init__(self, vocab_size: int, device: Any, greenlist_ratio: float = 0.25, bias: float = 2.0,
                 hashing_key: int = 15485863, seeding_scheme: str = "lefthash", context_width: int = 1) -> None:
        if seeding_scheme not in ("selfhash", "lefthash"):
            raise ConfigError(f'`seeding_scheme` must be "lefthash" or "selfhash"; got {seeding_scheme!r}')
        if not 0.0 < greenlist_ratio < 1.0:
            raise ConfigError(f"`greenlist_ratio` must be a number in (0, 1); got {greenlist_ratio!r}")
        if not isinstance(context_width, int) or context_width < 1:
            raise ConfigError(f"`context_width` must be an int >= 1; got {context_width!r}")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"`vocab_size` must be an int >= 1; got {vocab_size!r}")
        self.bias = float(bias)
        self.seeding_scheme = seeding_scheme
        self.context_width = context_width
        self.green = GreenLists(vocab_size, device, greenlist_ratio, hashing_key, seeding_scheme, context_width)

    # transformers' attribute names, read by code written for its WatermarkLogitsProcessor
    @property
    def vocab_size(self) -> int:
        return self.green.vocab_size

    @property
    def greenlist_size(self) -> int:
        """How many tokens are green at each step: ``int(vocab_size * greenlist_ratio)``."""
        return self.green.greenlist_size

    @property
    def hash_key(self) -> int:
        return self.green.hashing_key

    @property
    def table_size(self) -> int:
        return TABLE_SIZE

    @property
    def fixed_table(self) -> torch.Tensor:
        return self.green.fixed_table

    @property
    def rng(self) -> torch.Generator:
        return self.green.rng

    def _selfhash_greenlist(self, seq: torch.Tensor, scores: torch.Tensor) -> list[int]:
        """The best-scoring candidates that are green in the context they would complete."""
        _, order = scores.sort(dim=-1, descending=True)
        context = seq[-(self.context_width - 1):].tolist() if self.context_width > 1 else []
        found = []
        for token in order[:SELFHASH_CANDIDATES].tolist():
            if self.green.is_green((*context, token), token):
                found.append(token)
        return found

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] < self.context_width:
            logger.warning("the sequence has %d tokens, fewer than context_width=%d: no watermark at this step",
                           input_ids.shape[-1], self.context_width)
            return scores
        out = scores.clone()
        for row, seq in enumerate(input_ids):
            if self.seeding_scheme == "selfhash":
                green = torch.tensor(self._selfhash_greenlist(seq, scores[row]), dtype=torch.long,
                                     device=scores.device)
            else:
                green = self.green.greenlist(seq).to(scores.device)
            if green.numel():
                out[row, green] += self.bias
        return out


def make_watermark(config: Any, ctx: ProcessorContext) -> Any:
    """Factory of the ``watermark`` processor: ``config.watermarking_config.construct_processor``
    with the model's vocabulary size (any watermark config, a pack's included)."""
    wm = config.watermarking_config
    if wm is None:
        return None
    vocab_size = model_vocab_size(ctx.model)
    if vocab_size is None:
        raise ConfigError("`watermarking_config` needs the model's vocabulary size (model.config.vocab_size)")
    return wm.construct_processor(int(vocab_size), ctx.device)
