"""The block allocator of continuous batching: which blocks of the paged cache belong to whom.

The K/V tensors live in the model's paged store (:class:`genkit.models.paged.PagedKVStore`); this
module only counts blocks. A request owns a list of blocks (its block table). Blocks go back to the
pool when their request finishes, fails, is cancelled or evicted.

**The prompt cache.** When a request's prompt has been computed, its prompt blocks are published
(and when it finishes, the blocks of its completion too, for the next turn of a conversation):
a block's keys and values depend only on the tokens up to its last position, so a block is found
by the tokens it holds under the block before it (a chain from the prompt's start, compared token
for token: no hash that two prompts could share). A later request whose prompt starts with the same
tokens

- takes the published *full* blocks of that prefix by reference (a full prompt block is never
  written again: a request only writes past its prompt's cached part), and
- gets the longest matching run of the next block (a partial block, or the start of a full one),
  token for token: the block itself when nobody holds it and the request writes only past that
  run, else a *copy* into a fresh block of its own, queued here (:meth:`take_copies`) and made by
  the manager before the step that needs it.

A published block nobody holds any more is not freed: it stays in the cache, idle, until an
allocation needs it (least recently used first), so a prompt sent again after its first request
finished is found too (what llama.cpp's server does per slot, and vLLM's automatic prefix caching
does by blocks). At least one prompt token is always left to compute, for the first logits.

**Scored prompts.** A prompt whose tokens are scored (``add_request(prompt_logprobs=k)``) publishes
its tokens' scores with its blocks: a token's score depends only on the tokens up to it, as a
block's keys and values do. A later scored prompt takes a cached prefix only as far as its tokens'
scores were published with at least as many alternatives (:meth:`published_scores`), less one
token: the logits of a prefix's last position (which score the first token past it) were never
kept, so that position is computed again (:meth:`scored_prefix`). An evaluation harness's choices
that share a context (lm-evaluation-harness's multiple-choice loglikelihoods) compute it once.
Scores with more than :attr:`BlockAllocator.max_published_top` alternatives per token are not kept
(their memory: the cache holds up to ``num_blocks * block_size`` tokens' scores).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from genkit.models.paged import blocks_for

__all__ = ["BlockAllocator"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class BlockAllocator:
    """Free list, reference counts and the prompt cache over ``num_blocks`` blocks of
    ``block_size`` slots (not thread-safe: the manager's loop owns it)."""

    max_published_top = 20  # alternatives per token of the scores kept with the blocks (vLLM's default max_logprobs)

    def __init__(self, *, block_size: int, num_blocks: int, allow_block_sharing: bool = True) -> None:
        self.block_size, self.num_blocks = block_size, num_blocks
        # taken from the right: the block given back last is the next one handed out (its pages are mapped
        # and in cache; a block never used costs its first touches: 180 page faults for SmolLM2's 30 layers)
        self._free: deque[int] = deque(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.allow_block_sharing = allow_block_sharing
        self._idle: OrderedDict[int, None] = OrderedDict()  # published blocks nobody holds, oldest first
        self._entry: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # block -> (its node, parent node, tokens)
        self._full: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, block_size tokens) -> block
        # (parent node, first token) -> {block: its tokens}: the blocks that may continue a prefix
        self._children: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
        self._nodes = itertools.count(1)  # node 0 is the prompt's start; a node id is never reused
        self._copies: list[tuple[int, int, int]] = []  # (source, destination, tokens) before the next step
        # block -> (alternatives per token, the scores of the first tokens of its run): a scored prompt's
        self._scores: dict[int, tuple[int, tuple[Any, ...]]] = {}

    # -- allocation -------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: the free ones and the idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def capacity(self) -> int:
        """Tokens the whole cache holds (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        """Idle blocks that still hold a published prompt prefix."""
        return len(self._idle)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.free_blocks:
            raise MemoryError(f"the paged cache has {self.free_blocks} free blocks; {n} needed")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()  # the most recently given back (warm), else the lowest never used
            else:
                b, _ = self._idle.popitem(last=False)  # the least recently used cached prefix
                self._unindex(b)  # it is about to hold other tokens
                self._scores.pop(b, None)
            self._refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Give back one reference to each of ``blocks`` (a request's block table). The last
        block goes idle first, so a cached chain is evicted from its end and its prefix stays."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                dropped = [c for c in self._copies if c[1] == b]  # copies into a block given back
                if dropped:
                    self._copies = [c for c in self._copies if c[1] != b]
                    self.release([src for src, _, _ in dropped])
                if b in self._entry:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def _take(self, b: int) -> None:
        """One more reference to ``b`` (out of the idle cache if nobody held it)."""
        if self._refs[b] == 0:
            del self._idle[b]
        self._refs[b] += 1

    # -- the prompt cache -------------------------------------------------------------------------
    def cached_prefix(self, prompt: list[int]) -> tuple[list[int], int]:
        """The blocks a new request with ``prompt`` starts with, and how many of its tokens they
        hold: the published full blocks of its longest cached prefix (each gains a reference),
        then the block holding the longest matching run of the next cached block: that block
        itself when the request can take it (:meth:`_adoptable`), else a fresh block the run is
        copied into (queued for :meth:`take_copies`). ``([], 0)`` when nothing matches."""
        if not self.allow_block_sharing:
            return [], 0
        bs, limit = self.block_size, len(prompt) - 1
        out: list[int] = []
        parent = 0
        while (len(out) + 1) * bs <= limit:
            b = self._full.get((parent, tuple(prompt[len(out) * bs:(len(out) + 1) * bs])))
            if b is None:
                break
            out.append(b)
            parent = self._entry[b][0]
        for b in out:
            self._take(b)
        cached = len(out) * bs
        src, n = self._longest_run(parent, prompt[cached:limit])
        if n > 0 and self._adoptable(src, n, prompt[cached:]):
            self._take(src)  # the request writes past the block's cached run: no copy needed
            out.append(src)
            cached += n
        elif n > 0 and self.free_blocks > (self._refs[src] == 0):
            self._take(src)  # held until the copy is made
            dst = self.allocate(1)[0]
            self._copies.append((src, dst, n))
            out.append(dst)
            cached += n
        return out, cached

    def _adoptable(self, b: int, n: int, rest: list[int]) -> bool:
        """Whether a request whose remaining prompt is ``rest`` (its first ``n`` tokens in ``b``)
        can take the idle block ``b`` itself: it writes nothing over ``b``'s cached run but the
        same token's keys and values again (its last prompt token, when the run holds it)."""
        run = self._entry[b][2]
        return self._refs[b] == 0 and (n == len(run) or (n == len(run) - 1 and rest[n] == run[n]))

    def _longest_run(self, parent: int, rest: list[int]) -> tuple[int, int]:
        """The cached block under ``parent`` whose tokens start like ``rest`` for longest, and how
        many tokens match."""
        best, most = -1, 0
        for b, tokens in self._children.get((parent, rest[0]), {}).items() if rest else ():
            n = common_prefix(tokens, rest)
            if n > most:
                best, most = b, n
        return best, most

    def scored_prefix(self, prompt: list[int], top: int) -> tuple[list[int], int, list[Any]]:
        """:meth:`cached_prefix` for a prompt scored with ``top`` alternatives per token: the blocks,
        the tokens they hold, and the published scores of those tokens but the first (each with
        its published alternatives, ``top`` or more). Only a prefix whose scores were published is
        taken, less its last token (its position's logits score the token after it)."""
        scores = self.published_scores(prompt, top)
        if len(scores) < 2:
            return [], 0, []
        blocks, cached = self.cached_prefix(prompt[:len(scores)])  # leaves the last scored token to compute
        return blocks, cached, scores[1:cached + 1]

    def published_scores(self, prompt: list[int], top: int) -> list[Any]:
        """The scores published with at least ``top`` alternatives of ``prompt``'s longest prefix
        that has them, one per token (the prompt's first token's is None); ``[]`` when none."""
        bs, out, parent = self.block_size, [], 0
        while len(out) + bs <= len(prompt):
            b = self._full.get((parent, tuple(prompt[len(out):len(out) + bs])))
            found = self._scores.get(b) if b is not None else None
            if found is None or found[0] < top:
                break
            out += found[1]
            if len(found[1]) < bs:
                return out
            parent = self._entry[b][0]
        rest, best = prompt[len(out):], ()
        for b, run in self._children.get((parent, rest[0]), {}).items() if rest else ():
            found = self._scores.get(b)
            if found is not None and found[0] >= top:
                best = max(best, found[1][:common_prefix(run, rest)], key=len)
        return out + list(best)

    def publish(self, tokens: list[int], blocks: list[int], computed: int, *,
                scores: Sequence[Any] | None = None, top: int = 0) -> None:
        """Offer the blocks of a request whose first ``computed`` ``tokens`` are in the cache (its
        prompt once computed; its prompt and completion when it finishes, for the next turn of a
        conversation) to later requests whose prompts start the same way. ``scores``: those of the
        first tokens (the first token's None), with ``top`` alternatives each (a scored prompt's)."""
        if not self.allow_block_sharing:
            return
        bs, end = self.block_size, min(computed, len(tokens))
        parent = 0
        for i in range(self.blocks_for(end)):
            run = tuple(tokens[i * bs:min(end, (i + 1) * bs)])
            parent, held = self._publish_block(blocks[i], parent, run)
            if scores is not None and top <= self.max_published_top and held >= 0 and len(scores) > i * bs:
                self._keep_scores(held, top, tuple(scores[i * bs:i * bs + len(run)]))
            if parent < 0:
                return

    def _keep_scores(self, b: int, top: int, scores: tuple[Any, ...]) -> None:
        """Record ``scores`` (of the first tokens of ``b``'s run) unless ``b`` has ones as long
        with as many alternatives."""
        old = self._scores.get(b)
        if old is None or (top >= old[0] and len(scores) >= len(old[1])):
            self._scores[b] = (top, scores)

    def _publish_block(self, b: int, parent: int, run: tuple[int, ...]) -> tuple[int, int]:
        """Publish block ``b``, holding ``run``, under node ``parent``; returns the node the next
        block goes under (-1: stop here) and the block published for ``run`` (-1: none)."""
        entry = self._entry.get(b)
        if entry is not None:  # published before: a block this request shares, or its own partial run
            node, parent, old = entry
            if len(old) < len(run):  # the request wrote on after it: the longer run is cached now
                self._unindex(b)
                self._index(b, node, parent, run)
        else:
            same = self._full.get((parent, run)) if len(run) == self.block_size else None
            if same is not None:  # the same prefix computed twice: follow the published one
                return self._entry[same][0], same
            if any(t[:len(run)] == run for t in self._children.get((parent, run[0]), {}).values()):
                return -1, -1  # this run is cached already (a run shorter than a block is the last)
            node = next(self._nodes)
            self._index(b, node, parent, run)
        canonical = self._full.get((parent, run), b) if len(run) == self.block_size else b
        return self._entry[canonical][0], canonical  # b's own node unless another block holds the same prefix

    def _index(self, b: int, node: int, parent: int, run: tuple[int, ...]) -> None:
        self._entry[b] = (node, parent, run)
        self._children.setdefault((parent, run[0]), {})[b] = run
        if len(run) == self.block_size:
            self._full.setdefault((parent, run), b)

    def _unindex(self, b: int) -> None:
        """Unpublish ``b``; blocks published under it become unreachable and leave the cache as
        they are reallocated."""
        _, parent, run = self._entry.pop(b)
        if self._full.get((parent, run)) == b:
            del self._full[(parent, run)]
        siblings = self._children.get((parent, run[0]), {})
        siblings.pop(b, None)
        if not siblings:
            self._children.pop((parent, run[0]), None)

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The copies queued since the last call, ``(source block, destination block, tokens)``:
        the caller copies the first ``tokens`` slots of each source into its destination, then
        :meth:`release`\\ s the sources (held until then)."""
        out, self._copies = self._copies, []
        return out

