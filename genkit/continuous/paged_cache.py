"""The paged KV cache of continuous batching: fixed-size blocks, a block table per request.

Each layer's keys and values live in one tensor of ``num_blocks`` blocks
(``(blocks, block_size, kv_heads, head_dim)``); a request owns a list of blocks, and its token
``i`` sits in slot ``blocks[i // block_size] * block_size + i % block_size`` of the flattened
tensor. Blocks go back to the free list
when their request finishes, fails, is cancelled or evicted. A full block of prompt tokens can be
shared by requests whose prompts start with the same tokens (reference-counted, found by a hash
of the whole prefix up to that block): such a block is never written again, since a request only
ever writes past its shared prefix.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Keys, values and the block allocator (not thread-safe: the manager's loop owns it)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", allow_block_sharing: bool = True) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ConfigError(f"the paged cache needs block_size >= 1 and num_blocks >= 1; got {block_size}, "
                              f"{num_blocks}")
        self.block_size, self.num_blocks = block_size, num_blocks
        # (blocks, block_size, kv_heads, head_dim): a block is contiguous, so gathering a request's
        # blocks copies whole blocks; ``flat(layer)`` views the same memory as slots
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.allow_block_sharing = allow_block_sharing
        self._by_prefix: dict[Any, int] = {}  # prefix key -> a full, shared prompt block
        self._prefix_of: dict[int, Any] = {}

    # -- allocation -------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"the paged cache has {len(self._free)} free blocks; {n} needed")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                key = self._prefix_of.pop(b, None)
                if key is not None and self._by_prefix.get(key) == b:
                    del self._by_prefix[key]
                self._free.append(b)

    # -- prefix sharing ---------------------------------------------------------------------------
    def shared_prefix(self, prompt: list[int]) -> list[int]:
        """The blocks already holding the longest run of full blocks of ``prompt`` (each gains a
        reference). At least one prompt token is always left to compute, for the first logits."""
        if not self.allow_block_sharing:
            return []
        out: list[int] = []
        full = (len(prompt) - 1) // self.block_size
        for i in range(full):
            block = self._by_prefix.get(tuple(prompt[:(i + 1) * self.block_size]))
            if block is None:
                break
            out.append(block)
        for b in out:
            self._refs[b] += 1
        return out

    def publish(self, prompt: list[int], blocks: list[int], computed: int) -> None:
        """Offer the full prompt blocks of a request (whose first ``computed`` tokens are in the
        cache) to later requests with the same prefix."""
        if not self.allow_block_sharing:
            return
        for i in range(min(computed, len(prompt) - 1) // self.block_size):
            key = tuple(prompt[:(i + 1) * self.block_size])
            if key not in self._by_prefix and blocks[i] not in self._prefix_of:
                self._by_prefix[key] = blocks[i]
                self._prefix_of[blocks[i]] = key

    # -- slots ------------------------------------------------------------------------------------
    def slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Slot indices of token positions ``start..stop-1`` of a request holding ``blocks``."""
        pos = torch.arange(start, stop)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
