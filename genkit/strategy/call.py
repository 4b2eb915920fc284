"""The strategy call as one frozen object, and the stop conditions as data."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from genkit.errors import ConfigError

from .processing import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

__all__ = ["MODEL_INPUTS", "StopConditions", "StrategyCall"]

#: model inputs every strategy accepts (besides the prompt)
MODEL_INPUTS = ("attention_mask", "past_key_values", "use_cache", "position_ids")


@dataclass(frozen=True)
class StopConditions:
    """When a row is done: ``max_length`` tokens (prompt included), one of the ``eos`` ids, or a
    ``criteria`` entry (``criterion(input_ids, scores) -> BoolTensor (rows,)``) saying so.

    Built once by ``generate``'s ``prepare`` from the config; strategies read the fields and never
    look at criterion types. It is also callable like a ``StoppingCriteriaList`` (and iterable), so
    a recipe written for transformers can use it as ``stopping_criteria``.
    """

    max_length: int
    eos: torch.Tensor | None = None
    criteria: tuple[Any, ...] = ()

    @classmethod
    def from_criteria(cls, criteria: Iterable[Any] | None, config: Any) -> StopConditions:
        """Stop conditions for a strategy called directly with a plain list of criteria: every
        criterion is called at each step; ``max_length`` comes from the list
        (``StoppingCriteriaList.max_length``) or the config."""
        if isinstance(criteria, StopConditions):
            return criteria
        items = tuple(criteria or ())
        max_length = StoppingCriteriaList(items).max_length or config.max_length
        return cls(max_length=int(max_length), criteria=items)

    @property
    def pads_finished(self) -> bool:
        """Whether finished rows get the pad token (transformers does so when an EOS condition exists)."""
        return self.eos is not None or any(hasattr(c, "eos_token_id") for c in self.criteria)

    @property
    def may_finish_early(self) -> bool:
        """Whether a row can end before ``max_length``."""
        return self.eos is not None or bool(self.criteria)

    def to(self, device: torch.device) -> StopConditions:
        if self.eos is None or self.eos.device == device:
            return self
        return StopConditions(self.max_length, self.eos.to(device), self.criteria)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """``(rows,)`` bool: which rows of ``input_ids`` are done (every condition)."""
        done = torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.max_length, dtype=torch.bool,
                          device=input_ids.device)
        if self.eos is not None:
            done = done | torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
        for criterion in self.criteria:
            # a criterion may answer on another device (a CPU tensor for a model on a GPU)
            done = done | torch.as_tensor(criterion(input_ids, scores, **kwargs), device=done.device)
        return done

    def as_list(self) -> StoppingCriteriaList:
        """The conditions as criterion objects (max length, the criteria, EOS)."""
        items: list[Any] = [MaxLengthCriteria(self.max_length), *self.criteria]
        if self.eos is not None:
            items.append(EosTokenCriteria(self.eos))
        return StoppingCriteriaList(items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.as_list())

    def __len__(self) -> int:
        return 1 + len(self.criteria) + (self.eos is not None)


@dataclass(frozen=True)
class StrategyCall:
    """Everything a strategy receives, read once.

    A strategy is called as ``decode(model, input_ids, *, logits_processor, stopping_criteria,
    generation_config, streamer, **model_inputs)``; :meth:`from_kwargs` turns that call into this
    object (refusing model inputs the strategy does not accept).
    """

    model: Any
    input_ids: torch.Tensor
    config: Any
    logits_processor: Any
    stop: StopConditions
    streamer: Any = None
    attention_mask: torch.Tensor | None = None
    past_key_values: Any = None
    position_ids: torch.Tensor | None = None
    use_cache: bool = True
    #: further inputs the strategy asked for with ``accept=`` (e.g. ``assistant_model``)
    extras: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: the strategy's name as errors show it
    name: str = "this strategy"
    #: the ``tokenizer=`` passed to ``generate`` (``None`` when none was), for strategies and
    #: candidate generators that work with text (e.g. a corpus of texts to draft from)
    tokenizer: Any = None

    @classmethod
    def from_kwargs(cls, strategy: str, model: Any, input_ids: torch.Tensor, /, *,
                    accept: Iterable[str] = (), **kwargs: Any) -> StrategyCall:
        """Read a strategy call. ``strategy`` names the strategy in errors; ``accept`` names
        the extra keyword inputs it takes (they land in :attr:`extras`, ``None`` when absent)."""
        try:
            logits_processor = kwargs.pop("logits_processor")
            stopping_criteria = kwargs.pop("stopping_criteria")
            config = kwargs.pop("generation_config")
        except KeyError as exc:
            raise ConfigError(f"{strategy} was called without `{exc.args[0]}`; a strategy receives "
                              "logits_processor, stopping_criteria and generation_config") from None
        streamer = kwargs.pop("streamer", None)
        tokenizer = kwargs.pop("tokenizer", None)
        inputs = {k: kwargs.pop(k) for k in MODEL_INPUTS if k in kwargs}
        extras = {k: kwargs.pop(k, None) for k in accept}
        if kwargs:
            raise ConfigError(f"unexpected model inputs for {strategy}: {sorted(kwargs)}")
        device = input_ids.device
        return cls(
            model=model, input_ids=input_ids, config=config, logits_processor=logits_processor,
            stop=StopConditions.from_criteria(stopping_criteria, config).to(device), streamer=streamer,
            attention_mask=inputs.get("attention_mask"), past_key_values=inputs.get("past_key_values"),
            position_ids=inputs.get("position_ids"),
            use_cache=bool(inputs.get("use_cache", True) and config.use_cache),
            extras=MappingProxyType(extras), name=strategy, tokenizer=tokenizer,
        )

    # -- derived ------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def max_length(self) -> int:
        return self.stop.max_length

    @property
    def pad_token_id(self) -> int:
        """The token written after a row finishes (the config's pad id, else 0)."""
        pad = self.config.pad_token_id
        return int(pad) if pad is not None else 0

    def refuse(self, *names: str) -> None:
        """Raise when one of the model inputs ``names`` was passed (a strategy that cannot use it)."""
        given = sorted(n for n in names if getattr(self, n, None) is not None)
        if given:
            raise ConfigError(f"unexpected model inputs for {self.name}: {given}")
