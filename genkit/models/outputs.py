"""Model outputs that behave like transformers' ``ModelOutput``, without depending on transformers.

A :class:`ModelOutput` is a dataclass and an ordered dict at once: its fields are attributes
(``out.logits``), its non-``None`` fields are its keys (``out["logits"]``, ``"loss" in out``,
``out.keys()``), an integer or a slice indexes :meth:`to_tuple` (``out[0]``), and setting an
attribute or a key sets both.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch


class ModelOutput(OrderedDict):  # type: ignore[type-arg]
    """The base of genkit's forward outputs (see the module docstring). Subclasses are dataclasses
    whose fields all default to ``None``."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                super().__setitem__(f.name, value)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dataclass_fields__:  # type: ignore[attr-defined]
            if value is None:
                super().pop(name, None)
            else:
                super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __delitem__(self, key: Any) -> None:
        from ..errors import NotSupportedError

        raise NotSupportedError(f"cannot delete {key!r} from a {type(self).__name__}; set it to None instead")

    def to_tuple(self) -> tuple[Any, ...]:
        """The non-``None`` fields' values, in field order."""
        return tuple(self[k] for k in self.keys())

    def __reduce__(self) -> Any:  # copy / pickle through the dataclass fields
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))  # type: ignore[arg-type]


class _WithCache(ModelOutput):
    """An output holding ``past_key_values``, also read and set as ``cache`` (transformers 5.24's name)."""

    past_key_values: Any

    @property
    def cache(self) -> Any:
        """``past_key_values`` under transformers 5.24's name for it."""
        return self.past_key_values

    @cache.setter
    def cache(self, value: Any) -> None:
        self.past_key_values = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keys={list(self.keys())})"


@dataclass(eq=False, repr=False)
class CausalLMOutput(_WithCache):
    """What a native causal LM's forward returns (transformers' ``CausalLMOutputWithPast``):
    ``loss`` (with ``labels=``), ``logits``, ``past_key_values`` (also read and set as ``cache``,
    transformers 5.24's name), ``hidden_states`` (embeddings
    first), ``attentions`` (one ``(batch, heads, query, key)`` tensor per layer, with
    ``output_attentions=True``)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass(eq=False, repr=False)
class BaseModelOutputWithPast(_WithCache):
    """What a native model's decoder (``model.get_decoder()``) returns, as transformers' base model
    (``LlamaModel``...): ``last_hidden_state`` (the final norm's output), ``past_key_values`` (also
    ``cache``), ``hidden_states`` (embeddings first, with ``output_hidden_states=True``) and
    ``attentions`` (with ``output_attentions=True``)."""

    last_hidden_state: torch.Tensor | None = None
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
