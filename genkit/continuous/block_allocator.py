"""The block allocator of continuous batching: which blocks of the paged cache belong to whom.

The K/V tensors live in the model's paged store (:class:`genkit.models.paged.PagedKVStore`); this
module only counts blocks. A request owns a list of blocks (its block table). Blocks go back to the
free list when their request finishes, fails, is cancelled or evicted. A full block of prompt
tokens can be shared by requests whose prompts start with the same tokens (reference-counted,
found by the whole prefix up to that block): such a block is never written again, since a request
only ever writes past its shared prefix.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from genkit.models.paged import blocks_for

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Free list, reference counts and prefix sharing over ``num_blocks`` blocks of ``block_size``
    slots (not thread-safe: the manager's loop owns it)."""

    def __init__(self, *, block_size: int, num_blocks: int, allow_block_sharing: bool = True) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
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
        return blocks_for(tokens, self.block_size)

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
