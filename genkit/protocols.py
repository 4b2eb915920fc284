"""The contracts between genkit's pieces, declared as :class:`typing.Protocol` classes.

Strategies (built-in or from packs) rely on these names only; nothing probes for alternatives.
Native models and their :class:`~genkit.KVCache` implement them directly; a transformers model
is adapted once, at the boundary (``genkit.models.adapter``), and so is a transformers cache
passed in as ``past_key_values``.

=====================  =====================================================================
protocol               what it is
=====================  =====================================================================
:class:`Cache`         key/value cache: ``get_seq_length``, ``crop``, ``reorder``,
                       ``repeat_interleave``, ``select`` (one name per operation)
:class:`ModelOutput`   what a forward returns: ``logits``, ``past_key_values``, ``hidden_states``
:class:`CausalLM`      the model: transformers' calling convention plus ``config``, ``device``...
:class:`PartialDepthLM`  a causal LM that can stop after its first ``num_layers`` layers
:class:`PagedLM`       a causal LM that continuous batching can run (the paged forward)
:class:`CandidateGenerator`  a draft source for assisted decoding
:class:`Streamer`      receives tokens as they are chosen; ``end()`` once at the end
=====================  =====================================================================
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Cache", "CandidateGenerator", "CausalLM", "ModelOutput", "PagedLM", "PartialDepthLM", "Streamer"]


@runtime_checkable
class Cache(Protocol):
    """A key/value cache over a batch of rows; one method per operation.

    Optional: ``record_past(on: bool)``, for a cache that drops the positions leaving a sliding
    window (transformers' ``DynamicCache``, adapted): while on, it keeps them until the next
    ``crop`` so a crop can roll back past the window (``genkit.strategy.Stepper.rollback``)."""

    def get_seq_length(self, layer: int = 0) -> int:
        """Number of positions held."""
        ...

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        ...

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (beam search)."""
        ...

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (prompt expanded to beams or samples)."""
        ...

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows in ``index``."""
        ...


class ModelOutput(Protocol):
    """The result of a forward pass (transformers' names)."""

    @property
    def logits(self) -> torch.Tensor:
        """``(batch, kept positions, vocab)``."""
        ...

    @property
    def past_key_values(self) -> Any:
        """The cache that was passed (filled further), or ``None``."""
        ...

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...] | None:
        """Embeddings first, then one tensor per layer (the last after the final norm)."""
        ...


@runtime_checkable
class CausalLM(Protocol):
    """What every strategy may rely on (native models implement it, transformers models are
    wrapped by ``genkit.models.adapter.wrap_transformers_model``)."""

    config: Any
    generation_config: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = ...,
                 position_ids: torch.Tensor | None = ..., past_key_values: Any = ..., use_cache: bool = ...,
                 output_hidden_states: bool = ..., logits_to_keep: int = ...) -> ModelOutput:
        """Forward pass with transformers' calling convention."""
        ...

    def new_cache(self, max_length: int = 0) -> Cache:
        """An empty cache for this model, sized for ``max_length`` positions when it can use the hint."""
        ...

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from any layer's hidden state (final norm, then the LM head): early exit, DoLa."""
        ...


@runtime_checkable
class PartialDepthLM(Protocol):
    """A causal LM whose forward can stop after its first ``num_layers`` decoder layers (early exit).

    ``supports_partial_depth`` is ``True`` and the forward takes ``num_layers=``; the returned
    logits are then the LM head applied (after the final norm) to that layer's output.
    """

    supports_partial_depth: bool

    def __call__(self, input_ids: torch.Tensor, *, num_layers: int | None = ..., **kwargs: Any) -> ModelOutput: ...


@runtime_checkable
class PagedLM(Protocol):
    """A causal LM that continuous batching can run: one forward over a flat stream of many
    requests' tokens, their keys and values in a paged store (``genkit.models.paged``). Which
    blocks of the store each request holds is decided by ``genkit.continuous``."""

    def paged_unsupported(self) -> str | None:
        """Why the paged forward cannot run on the model as it is now (hooks, sliding windows...);
        None when it can."""
        ...

    def new_paged_store(self, *, block_size: int, num_blocks: int) -> Any:
        """An empty :class:`genkit.models.paged.PagedKVStore` for this model; NotSupportedError with
        the reason when ``paged_unsupported()`` gives one."""
        ...

    def forward_paged(self, batch: Any, store: Any) -> torch.Tensor:
        """One step (:class:`genkit.models.paged.StepBatch`): the logits ``(k, vocab)`` of the
        requests that want them, in order; every new key and value written to ``store``. A model
        whose ``forward_paged`` also takes ``greedy=True`` (every request that wants logits picks
        their first maximum and reads nothing else) may return those token ids ``(k,)`` (int64)
        instead; the manager passes it only to a model whose signature has it."""
        ...


@runtime_checkable
class CandidateGenerator(Protocol):
    """A draft source for assisted decoding."""

    def get_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(input_ids followed by k drafted tokens, their draft logits (1, k, vocab) or None)``."""
        ...

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
        """After verification: ``num_matches`` drafted tokens were accepted."""
        ...


@runtime_checkable
class Streamer(Protocol):
    """Receives the prompt, then each step's tokens; ``end()`` once on every exit path."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...
