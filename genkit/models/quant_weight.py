"""The ``weight`` of genkit's quantized layers, for code written for transformers.

A quantized layer (:class:`~genkit.models.quant.Int4Linear`, :class:`~genkit.models.quant.WithBias`,
:class:`~genkit.models.quant.QuantizedEmbedding`) holds codes and scales, no float weight; code
written for transformers reads ``model.get_output_embeddings().weight.shape[0]`` (the vocabulary),
``model.lm_head.weight.dtype`` or a projection's ``weight``. :class:`QuantizedWeightModule` gives
such layers a read-only ``weight`` property: the float weight the layer computes with, de-quantized
on each read and never kept (a kept copy would hold the float model's memory the codes save).

Every failure to make it raises :class:`~genkit.errors.QuantizedWeightError`, an ``AttributeError``:
``hasattr(layer, "weight")``, as transformers, peft and accelerate probe layers, then answers False.
Writing ``weight`` raises it too. genkit's own code never reads this property: it tells quantized
layers from float ones by their type (docs/models.md, "Quantized weights").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import QuantizedWeightError
from . import block_kernel


class QuantizedWeightModule(nn.Module):
    """A module whose weight is held quantized, with a read-only, de-quantized ``weight`` property
    (:meth:`dequantized_weight`, which subclasses define)."""

    def dequantized_weight(self) -> torch.Tensor:
        """The float weight this layer computes with, made now."""
        raise NotImplementedError

    def _weight(self) -> torch.Tensor:
        try:
            with torch.no_grad():
                return self.dequantized_weight()
        except QuantizedWeightError:
            raise
        except Exception as exc:  # noqa: BLE001 - hasattr() swallows AttributeError only: every failure becomes one
            raise QuantizedWeightError(f"{type(self).__name__}.weight: the de-quantized weight could not be made "
                                       f"({type(exc).__name__}: {exc})") from exc

    @property
    def weight(self) -> torch.Tensor:
        """The float weight this layer computes with, de-quantized on each read (never kept: it would
        take the memory the codes save); read-only."""
        return self._weight()

    @weight.setter
    def weight(self, value: Any) -> None:
        raise _read_only(self)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # (nn.Module would register a Parameter or Module as its own, past the property)
            raise _read_only(self)
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # the property raised (Python then asks __getattr__): its error, not nn.Module's
            return self._weight()
        return super().__getattr__(name)


def _read_only(module: nn.Module) -> QuantizedWeightError:
    return QuantizedWeightError(f"{type(module).__name__}.weight is read-only: the layer holds its weight quantized "
                                "and de-quantizes it on each read (quantize a float layer to replace it)")


def blocks_weight(blocks: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The float32 ``(out_features, in)`` weight of a block-kernel layer's ``blocks``
    (:func:`genkit.models.block_kernel.unpack`): ``codes * scale + minimum`` per group, in float32 as
    the ``gguf`` package de-quantizes (its Q4_0/Q4_1/Q8_0/Q6_K weights bit for bit; Q4_K's up to the
    float16 rounding of its scales ``d * sc`` and offsets ``dmin * m``, which the block kernel stores)."""
    codes, scale, minimum = block_kernel.unpack(blocks, bits, out_features)
    k = codes.shape[1]
    group = k // scale.shape[1]
    w = codes.float().view(out_features, k // group, group)
    return w.mul_(scale.unsqueeze(-1)).add_(minimum.unsqueeze(-1)).view(out_features, k)
