"""The key/value cache of genkit's native models.

One preallocated buffer per layer, grown by doubling, written in place: a decode step costs one
slice copy per layer and no concatenation. Supports what the strategies need: ``crop(n)``
(speculative rollback), ``reorder(index)`` (beam search), ``select(index)`` and
``repeat_interleave(n)`` (batch pruning and expansion).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ConfigError


class KVCache:
    """Per-layer key/value buffers of shape ``(batch, kv_heads, capacity, head_dim)``."""

    def __init__(self, num_layers: int, capacity: int = 0) -> None:
        self.num_layers = num_layers
        self.capacity_hint = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers
        # weak references to the model and its inference weights (or None) this cache started with,
        # and the hook-handle count then
        self.prepared: tuple[Any, Any, int] | None = None
        # positions a model computed beyond the length, with their greedy tokens
        # (genkit.models.self_speculation.Ahead); any other write drops them
        self.ahead: Any = None

    def __getstate__(self) -> dict[str, object]:
        # copies and pickles leave the model's prepared weights behind (oneDNN-packed tensors cannot
        # be copied); the model checks them again on the copy's first use
        return {**self.__dict__, "prepared": None, "ahead": None}

    # -- writing ----------------------------------------------------------------------------
    def update(self, layer: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor | int,
               cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` (``batch, heads, new, dim``) to ``layer`` and return views of the whole
        layer. transformers' order, ``update(key_states, value_states, layer_idx)``, is read too."""
        if isinstance(layer, torch.Tensor):  # transformers' Cache.update(key_states, value_states, layer_idx)
            layer, k, v = v, layer, k  # type: ignore[assignment]
        assert isinstance(layer, int) and isinstance(v, torch.Tensor)
        self.ahead = None
        start = self.lengths[layer]
        end = start + k.shape[2]
        kbuf = self.keys[layer]
        if kbuf is not None and kbuf.is_inference() and not torch.is_inference_mode_enabled():
            # filled inside generate() (inference mode); continue outside it on ordinary copies
            self.keys = [t.clone() if t is not None else None for t in self.keys]
            self.values = [t.clone() if t is not None else None for t in self.values]
            kbuf = self.keys[layer]
        if kbuf is None or end > kbuf.shape[2] or kbuf.shape[0] != k.shape[0]:
            kbuf, vbuf = self._grow(layer, k, end)
        else:
            vbuf = self.values[layer]
            assert vbuf is not None
        kbuf[:, :, start:end] = k
        vbuf[:, :, start:end] = v
        self.lengths[layer] = end
        return kbuf[:, :, :end], vbuf[:, :, :end]

    def reserve(self, layer: int, like: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make ``layer`` hold ``length`` positions whose keys and values the caller writes into the
        returned views ``(batch, kv_heads, length, head_dim)`` (``like``: a tensor of that batch,
        heads, head size, dtype and device), in buffers of at least ``capacity_hint`` positions (the
        layer's own where they are large enough): a cache filled from elsewhere in one copy
        (continuous batching's paged blocks)."""
        self.ahead = None
        self.lengths[layer] = 0
        kbuf, vbuf = self.keys[layer], self.values[layer]
        if (kbuf is None or vbuf is None or kbuf.shape[2] < max(length, self.capacity_hint)
                or kbuf.shape[:2] != like.shape[:2] or kbuf.shape[3] != like.shape[3] or kbuf.dtype != like.dtype
                or kbuf.device != like.device):
            kbuf, vbuf = self._grow(layer, like, length)  # (new buffers: nothing of the old is kept)
        self.lengths[layer] = length
        return kbuf[:, :, :length], vbuf[:, :, :length]

    def _grow(self, layer: int, k: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.ahead = None  # (the new buffers hold the first `lengths` positions only)
        old_k, old_v = self.keys[layer], self.values[layer]
        cap = max(needed, self.capacity_hint, 64)
        if old_k is not None:
            cap = max(cap, 2 * old_k.shape[2])
        shape = (k.shape[0], k.shape[1], cap, k.shape[3])
        new_k = torch.empty(shape, dtype=k.dtype, device=k.device)
        new_v = torch.empty(shape, dtype=k.dtype, device=k.device)
        n = self.lengths[layer]
        if old_k is not None and n:
            assert old_v is not None
            new_k[:, :, :n] = old_k[:, :, :n]
            new_v[:, :, :n] = old_v[:, :, :n]
        self.keys[layer], self.values[layer] = new_k, new_v
        return new_k, new_v

    # -- reading ----------------------------------------------------------------------------
    def get_seq_length(self, layer: int = 0) -> int:
        return self.lengths[layer]

    def __len__(self) -> int:
        return self.num_layers

    @property
    def seq_length(self) -> int:
        return self.lengths[0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[i], self.values[i]
        if k is None or v is None:
            raise IndexError(f"cache layer {i} is empty")
        n = self.lengths[i]
        return k[:, :, :n], v[:, :, :n]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(i)

    @property
    def key_cache(self) -> list[torch.Tensor]:
        """Each filled layer's keys ``(batch, kv_heads, length, head_dim)`` (transformers 4's
        ``Cache.key_cache``, for code written against it)."""
        return [self.layer(i)[0] for i in range(self.num_layers) if self.keys[i] is not None]

    @property
    def value_cache(self) -> list[torch.Tensor]:
        """Each filled layer's values (transformers 4's ``Cache.value_cache``)."""
        return [self.layer(i)[1] for i in range(self.num_layers) if self.values[i] is not None]

    @property
    def layers(self) -> list[CacheLayerView]:
        """Every layer as transformers 5's ``Cache.layers`` holds it (``.keys``, ``.values``,
        ``is_initialized``, ``get_seq_length()``), for code written against it: read-only views of
        the filled positions, made at each read."""
        return [CacheLayerView(self, i) for i in range(self.num_layers)]

    # -- editing ----------------------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        self.ahead = None
        for i in range(self.num_layers):
            n = max_length if max_length >= 0 else self.lengths[i] + max_length
            if n < 0:
                raise ConfigError(f"cannot crop the cache to {max_length}: it holds {self.lengths[i]} positions")
            self.lengths[i] = min(self.lengths[i], n)

    def _map(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.ahead = None
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                n = self.lengths[i]
                self.keys[i] = fn(self.keys[i][:, :, :n]).contiguous()  # type: ignore[index]
                self.values[i] = fn(self.values[i][:, :, :n]).contiguous()  # type: ignore[index]

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder batch rows (beam search): row ``i`` becomes old row ``index[i]``."""
        self.ahead = None
        for i in range(self.num_layers):
            k, v = self.keys[i], self.values[i]
            if k is not None and v is not None:
                idx = index.to(k.device)
                self.keys[i] = k.index_select(0, idx)
                self.values[i] = v.index_select(0, idx)


    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index``."""
        self.reorder(index)


    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times (expanding prompts to beams or samples)."""
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    # -- transformers' Cache method names (code written for transformers calls them) ------------
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """:meth:`reorder` under transformers' name."""
        self.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """:meth:`select` under transformers' name."""
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """:meth:`repeat_interleave` under transformers' name."""
        self.repeat_interleave(repeats)


class CacheLayerView:
    """One layer of a :class:`KVCache` under transformers 5's layer attribute names: ``keys`` /
    ``values`` the filled positions ``(batch, kv_heads, length, head_dim)`` (None before the first
    write), ``is_initialized``, ``get_seq_length()``."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self._cache, self._index = cache, index

    @property
    def is_initialized(self) -> bool:
        return self._cache.keys[self._index] is not None

    @property
    def keys(self) -> torch.Tensor | None:
        return self._cache.layer(self._index)[0] if self.is_initialized else None

    @property
    def values(self) -> torch.Tensor | None:
        return self._cache.layer(self._index)[1] if self.is_initialized else None

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self._index)


class TransformersCacheLayers:
    """A transformers cache (``DynamicCache``, ...) written by native layers: the forward of a native
    model called with one as ``past_key_values`` (as transformers' ``generate`` and code written
    for it do) stores its keys and values there, through ``update(layer, k, v)``. The cache keeps
    transformers' own methods for everything else (``crop``, ``reorder_cache``, ...)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` to ``layer`` and return the whole layer, one key per position seen, as
        genkit's layers and masks expect. transformers' layers return other lengths: a static layer
        its whole buffer (the positions seen first: cut to them), a sliding-window layer
        (``DynamicCache(config=...)`` of a model with ``sliding_window``, ``StaticCache``'s sliding
        layers) the last positions only (padded before with zeros to the positions seen: the
        window's mask leaves those out)."""
        keys, values = self.cache.update(k, v, layer)[:2]
        seen, held = int(self.cache.get_seq_length(layer)), keys.shape[-2]
        if held > seen:
            return keys[:, :, :seen], values[:, :, :seen]
        if held < seen:
            return F.pad(keys, (0, 0, seen - held, 0)), F.pad(values, (0, 0, seen - held, 0))
        return keys, values

    def get_seq_length(self, layer: int = 0) -> int:
        return int(self.cache.get_seq_length(layer))

    @property
    def prepared(self) -> Any:  # the native model's check of its inference weights, kept on the cache
        return getattr(self.cache, "_genkit_prepared", None)

    @prepared.setter
    def prepared(self, value: Any) -> None:
        self.cache._genkit_prepared = value


def native_cache(cache: Any) -> Any:
    """The cache a native model's layers write: genkit's own caches as they are; a transformers
    cache (bare, or as the strategies see it, wrapped in the adapter's ``TransformersCache``)
    through :class:`TransformersCacheLayers`."""
    from .adapter import TransformersCache, is_transformers_object

    if isinstance(cache, TransformersCache):
        cache = cache.cache
    if cache is None or isinstance(cache, KVCache) or not is_transformers_object(cache):
        return cache
    return TransformersCacheLayers(cache)
