"""The one-call decode steps of a model on the inference path: a batch-1 or unpadded decode step
from token ids to logits, greedy tokens or the top-k logits in one call of the block kernel
(:class:`~genkit.models.block_decode.BlockDecoder`: the embedding, every layer, the final norm and the
LM head), and greedy search by exact self-speculation (:mod:`genkit.models.self_speculation`).

:class:`OneCallModel` is what the Llama family (:class:`~genkit.models.llama.LlamaForCausalLM`) and
GPT-2 (:class:`~genkit.models.gpt2.GPT2LMHeadModel`) share: each names the modules around its layers
(:meth:`OneCallModel._end_modules`) and its rotary tables (:meth:`OneCallModel._rotary`; GPT-2 has
none, its learned positions are added to the embedding in the kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .base import GenkitModel
from .cache import KVCache
from .llama_infer import InferencePathModel, PreparedModel, has_hooks, module_path
from .self_speculation import DRAFT_MAX_BYTES, SelfDraft, build_draft, draft_bytes, speculate, take_ahead

logger = logging.getLogger("genkit.models")


def _drop_draft(model_ref: Any, prepared_ref: Any) -> None:
    """Release a model's self-speculation draft once the prepared weights it copies are gone."""
    model = model_ref()
    kept = None if model is None else model.__dict__.get("_self_draft")
    if kept is not None and kept[0] is prepared_ref:
        model.__dict__["_self_draft"] = None


def _implied(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, past_len: int) -> bool:
    """Whether a decode step's mask and positions are the ones a cache of ``past_len`` positions
    implies: no mask or one of all ones, no positions or ``past_len`` in every row."""
    if attention_mask is not None and (attention_mask.shape != (rows, past_len + 1) or not bool(attention_mask.all())):
        return False
    return position_ids is None or (position_ids.numel() == rows and bool((position_ids == past_len).all()))


class OneCallModel(InferencePathModel):
    """A model on the inference path with one-call decode steps (see the module docstring)."""

    #: greedy steps of a float32 model on the dense one-call decoder draft tokens with an 8-bit copy of
    #: the model and check them in one step (genkit.models.self_speculation; the same tokens, bit for
    #: bit): None does so where the copy stays under 2 GiB (about 2B parameters) and a round is measured
    #: faster than one token per step (long contexts may not be), True always, False never (one token
    #: per step)
    self_speculation: bool | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the self-speculation draft copies the prepared weights: rebuilt on first use, as they are
        return {**super().__getstate__(), "_self_draft": None}

    def one_call_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None, cache: Any, logits_to_keep: int | torch.Tensor
                      ) -> torch.Tensor | None:
        """A decode step on the block kernel's one-call decoder with the embedding, the final norm
        and the LM head in the same call (:meth:`BlockDecoder.logits`): between two calls of a
        step's kernel the CPU caches are cold, and the small torch operations around the layers
        cost several times what they cost warm. Only where the usual path would compute the same
        step: every row one token at the cache's length, positions and mask implied by it."""
        if not isinstance(logits_to_keep, int):
            return None
        return self._one_call("logits", input_ids, attention_mask, position_ids, cache)

    def greedy_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor | None:
        """:meth:`one_call_step`'s step giving each row's greedy token ``(rows,)`` (the argmax of
        the logits :meth:`forward` would give) instead of the logits
        (:meth:`~genkit.models.block_decode.BlockDecoder.argmax`: a float32 head is read through an
        8-bit copy, and only the logits that can be the largest are computed exactly); None where
        that step does not apply, or where calling the model would run more than
        :meth:`GenkitModel.forward` (a forward hook or pre-hook on it or global, a ``forward`` of a
        subclass or of the instance: they may change the logits)."""
        if not self._forward_as_is():
            return None
        if self.self_speculation is not False:
            token = self._speculative(input_ids, attention_mask, position_ids, cache)
            if token is not None:
                return token
        return self._one_call("argmax", input_ids, attention_mask, position_ids, cache)

    def _speculative(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor | None:
        """:meth:`greedy_step` by exact self-speculation (:mod:`genkit.models.self_speculation`): the
        token computed ahead, or a round of drafts checked in one step; None where that does not
        apply (batch 1, a float32 model on the dense one-call decoder, as :meth:`one_call_step`)."""
        if self.self_speculation not in (None, True):
            raise ConfigError(f"`self_speculation` must be None, True or False; got {self.self_speculation!r}")
        prepared = self._step_prepared(input_ids, attention_mask, position_ids, cache) if input_ids.shape[0] == 1 else None
        decoder = None if prepared is None else prepared.decoder
        if decoder is None or not decoder.dense:
            if self.self_speculation and prepared is not None and not self.__dict__.get("_speculation_warned"):
                self.__dict__["_speculation_warned"] = True  # (said once per model)
                logger.warning("self_speculation=True: this model's decode steps do not run on the float32 one-call "
                               "decoder (%s), so greedy search takes one token per step",
                               "a float32 model on the kernel choice's 'gemv' route: GENKIT_KERNEL=decode:gemv")
            return None
        token = int(input_ids[0, 0])
        known = take_ahead(cache, token, id(decoder))
        draft = self._draft_for(prepared)
        if known is not None:
            if draft is not None:
                draft.stats.answered_ahead += 1
            return torch.tensor([known])
        ends = self.kernel_ends(prepared)
        if ends is None or draft is None:
            return None
        out = speculate(draft, decoder, ends, self._rotary, token, cache, always=self.self_speculation is True)
        return None if out is None else torch.tensor([out])

    def speculating_cache(self, store: Any, blocks: list[int], length: int, capacity: int = 0,
                          reuse: KVCache | None = None) -> KVCache | None:
        """A :class:`KVCache` (room for ``capacity`` positions; ``reuse``'s buffers where they are large
        enough) holding positions ``0..length-1`` of a request's ``blocks`` of the paged ``store``
        (:class:`~genkit.models.paged.PagedKVStore`), started on the store's prepared weights, on which
        :meth:`greedy_step` self-speculates: continuous batching's way to decode a request that runs
        alone as batch-1 greedy ``generate`` does (genkit.continuous.solo). None where its steps would
        not speculate (:meth:`speculation_draft`)."""
        prepared = store.prepared
        if self.speculation_draft(prepared) is None:
            return None
        cache = reuse if reuse is not None else KVCache(len(prepared.layers))
        cache.capacity_hint = max(capacity, length)
        if self._inference_weights(cache, 0) is not prepared:
            return None
        for layer, kc in enumerate(store.keys):
            k, v = cache.reserve(layer, kc.new_empty(1, kc.shape[1], 0, kc.shape[3]), length)
            store.gather_into(layer, blocks, length, k[0], v[0])
        return cache

    def speculation_draft(self, prepared: PreparedModel | None) -> SelfDraft | None:
        """The draft greedy steps on ``prepared`` speculate with, made now if it was not (continuous
        batching makes it while it is idle, so that no request waits for it), or None where they do
        not speculate (``self_speculation`` False, a model whose steps do not run on the float32
        one-call decoder, a draft too large, hooks, autograd on)."""
        if self.self_speculation is False or not self._forward_as_is() or module_path() or prepared is None:
            return None
        if prepared.decoder is None or not prepared.decoder.dense or self.kernel_ends(prepared) is None:
            return None
        return self._draft_for(prepared)

    @staticmethod
    def extend_speculating_cache(cache: KVCache, store: Any, blocks: list[int], length: int) -> None:
        """Bring a cache of :meth:`speculating_cache` up to ``length`` positions from the request's
        ``blocks`` (the positions batched steps computed since it was made or last extended)."""
        start = cache.get_seq_length()
        if start < length:
            slots = store.slots(blocks, start, length)
            for layer in range(len(store.keys)):
                k, v = store.read(layer, slots)
                cache.update(layer, k[None], v[None])

    def _draft_for(self, prepared: PreparedModel) -> SelfDraft | None:
        """The 8-bit draft of ``prepared`` (made at its first speculative step, kept while it is the
        model's prepared weights), or None where it cannot be made."""
        kept = self.__dict__.get("_self_draft")
        if kept is not None and kept[0]() is prepared and (kept[1] is not None or kept[2] == self.self_speculation):
            return kept[1]  # type: ignore[no-any-return]
        self.__dict__["_self_draft"] = None  # the old draft goes first
        head, modules = prepared.for_rows(1)[1], self._end_modules()
        if head is None:  # the module's float weight; never a quantized head's de-quantized copy (quant_weight)
            head = self.lm_head.weight if type(self.lm_head) is nn.Linear else None
        draft = None
        if (modules is not None and head is not None
                and (self.self_speculation or draft_bytes(prepared, head) <= DRAFT_MAX_BYTES)):
            embed, norm, _lm_head, positions = modules
            try:
                draft = build_draft(prepared, embed, norm, head, positions)
            except (RuntimeError, MemoryError) as exc:  # (torch's out-of-memory error is a RuntimeError)
                logger.warning("no 8-bit draft for self-speculative greedy steps (%s): one token per step", exc)
        self.__dict__["_self_draft"] = (weakref.ref(prepared, functools.partial(_drop_draft, weakref.ref(self))), draft,
                                        self.self_speculation)
        return draft

    @property
    def speculation_stats(self) -> dict[str, int] | None:
        """What self-speculative greedy steps did on the current prepared weights (checks run, tokens
        drafted, drafts kept, tokens answered from what was computed ahead), or None before any."""
        kept = self.__dict__.get("_self_draft")
        return None if kept is None or kept[1] is None else dataclasses.asdict(kept[1].stats)

    def top_logits_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_ids: torch.Tensor | None, cache: Any, k: int) -> torch.Tensor | None:
        """:meth:`one_call_step`'s step for a filter to the ``k`` largest logits
        (:meth:`~genkit.models.block_decode.BlockDecoder.top`: exact where an entry can be among them,
        -inf elsewhere; a float32 head read through its 8-bit copy); None as for :meth:`greedy_step`."""
        if not self._forward_as_is():
            return None
        return self._one_call("top", input_ids, attention_mask, position_ids, cache, k)

    def _forward_as_is(self) -> bool:
        """Whether calling the model runs :meth:`GenkitModel.forward` and nothing else: no forward hook
        or pre-hook on it or global, no ``forward`` of a subclass or of the instance (they may change
        the logits a step gives)."""
        return "forward" not in self.__dict__ and type(self).forward is GenkitModel.forward and not has_hooks([self])

    def _one_call(self, what: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None, cache: Any, *extra: Any) -> torch.Tensor | None:
        """The one-call decoder's ``what`` (:meth:`BlockDecoder.logits`, :meth:`BlockDecoder.argmax`,
        :meth:`BlockDecoder.top` with ``extra``) for a decode step where the usual path would compute
        the same step (see :meth:`one_call_step`), else None."""
        prepared = self._step_prepared(input_ids, attention_mask, position_ids, cache)
        ends = None if prepared is None else self.kernel_ends(prepared)
        if prepared is None or ends is None:
            return None
        cos, sin = self._rotary(cache.get_seq_length(), 1)
        return getattr(prepared.decoder, what)(input_ids, cos, sin, cache, ends, *extra)  # type: ignore[no-any-return]

    def _step_prepared(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, cache: Any) -> PreparedModel | None:
        """The prepared weights a one-call decode step of ``input_ids`` runs on, or None where the usual
        path would compute another step (see :meth:`one_call_step`), the cache did not start on this
        model or runs the modules."""
        if (input_ids.dim() != 2 or input_ids.shape[1] != 1 or type(cache) is not KVCache
                or self.attn_implementation == "eager" or module_path()):
            return None
        past_len = cache.get_seq_length()
        if past_len == 0 or not _implied(attention_mask, position_ids, input_ids.shape[0], past_len):
            return None
        return self._weights_on(cache)[1]

    def kernel_ends(self, prepared: PreparedModel) -> Any:
        """The embedding, final norm and LM head as ``prepared``'s one-call decoder (a
        :class:`~genkit.models.block_decode.BlockDecoder`) runs them in its calls, or None when there
        is none or they must run as modules (:meth:`BlockDecoder.step_ends`; a final norm of another
        kind: :meth:`_end_modules`)."""
        modules, decoder = self._end_modules(), prepared.decoder
        if decoder is None or modules is None:
            return None
        embed, norm, lm_head, positions = modules
        return decoder.step_ends(embed, norm, lm_head, prepared.for_rows(1)[1], positions)

    def _end_modules(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module | None] | None:
        """The modules around the layers that a one-call step runs in the kernel: the token
        embedding, the final norm, the LM head and the learned positions' embedding (None: rotary
        positions); None when the final norm is of a kind the kernel does not compute."""
        raise NotImplementedError

    def _rotary(self, start: int, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """float32 cos/sin rows for positions ``start..start+n-1`` (``(n, head_dim)`` each), or
        (None, None) for a model without rotary positions."""
        raise NotImplementedError
