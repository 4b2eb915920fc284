"""transformers 5.24's assisted decoding, sampled, as the reference for genkit's: two bugs of its
draft model corrected, as the tests that need it say. Neither changes what the output follows (the
speculative sampling rule keeps the target's distribution whatever the draft proposes); both change
the drafts, so a seed gives other tokens. genkit does neither (its drafts come from the assistant's
distribution after the call's processors, applied once, on the sequence so far).

1. Its assistant applies the sampling warpers twice. ``AssistedCandidateGenerator`` hands the
   target's processors, warpers included, to ``assistant_model.generate`` with the target's
   generation config; ``_get_logits_processor`` merges that list into its own and then appends the
   warpers the config asks for again: a draft at ``temperature=0.7`` samples at 0.49, ``top_p``
   cuts twice (``top_k`` twice is the same cut). Decoder-only and encoder-decoder assistants alike.
2. Its encoder-decoder assistant re-reads the whole decoder sequence on top of its cache. From the
   second round on, ``assistant_model.generate(decoder_input_ids=<the whole sequence>, cache=<the
   assistant's cache, holding all but the last tokens>)`` runs ``_prefill``, which cuts the ids to
   the tokens the cache lacks only when a (decoder) attention mask as long as them is there, or
   ``generation_config._mask_length`` (set for decoder-only models only). An encoder-decoder
   assistant has neither, so after the first round it drafts from a context that holds its cached
   tokens twice: after ``[2, 33, 25]`` with ``[2]`` cached, it reads ``[2, 2, 33, 25]``.

:func:`witness` records both in an unpatched run; :func:`corrected` patches them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.generation import candidate_generator as CG
from transformers.generation import logits_process as LP
from transformers.generation.utils import GenerationMixin

# the processors `_get_logits_processor` appends for do_sample=True (after merging the caller's list)
WARPERS = (LP.TemperatureLogitsWarper, LP.TopKLogitsWarper, LP.TopPLogitsWarper, LP.MinPLogitsWarper,
           LP.TypicalLogitsWarper, LP.EpsilonLogitsWarper, LP.EtaLogitsWarper)


@contextmanager
def corrected(monkeypatch: Any) -> Iterator[None]:
    """transformers' assisted decoding with both bugs patched out (module doc): the assistant gets the
    target's processors without the warpers (its ``generate`` appends them, once, at the same place:
    after the others), and an encoder-decoder model's ``_prefill`` on a non-empty cache reads only
    the decoder tokens the cache lacks."""
    init, prefill = CG.AssistedCandidateGenerator.__init__, GenerationMixin._prefill

    def init_once_warped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.logits_processor = [p for p in self.logits_processor if not isinstance(p, WARPERS)]

    def prefill_past_the_cache(self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
                               *args: Any, **kwargs: Any) -> Any:
        cache = model_kwargs.get("cache")
        if self.config.is_encoder_decoder and cache is not None and cache.get_seq_length() > 0:
            input_ids = input_ids[:, cache.get_seq_length():]
        return prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(CG.AssistedCandidateGenerator, "__init__", init_once_warped)
        m.setattr(GenerationMixin, "_prefill", prefill_past_the_cache)
        yield


@contextmanager
def witness(monkeypatch: Any, assistant: Any) -> Iterator[dict[str, list]]:
    """Records, in an unpatched run, the processors of every ``assistant.generate`` call
    (``"processors"``: their class names) and each forward of ``assistant`` (``"forwards"``: the
    decoder ids it reads and how many tokens its cache held then)."""
    seen: dict[str, list] = {"processors": [], "forwards": []}
    get_processors = GenerationMixin._get_logits_processor

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        processors = get_processors(self, *args, **kwargs)
        if self is assistant:
            seen["processors"].append([type(p).__name__ for p in processors])
        return processors

    def pre_forward(module: Any, args: Any, kwargs: dict) -> None:
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        seen["forwards"].append((ids[0].tolist(), cache.get_seq_length() if cache is not None else 0))

    handle = assistant.register_forward_pre_hook(pre_forward, with_kwargs=True)
    try:
        with monkeypatch.context() as m:
            m.setattr(GenerationMixin, "_get_logits_processor", recording)
            yield seen
    finally:
        handle.remove()


@contextmanager
def guidance_followed(monkeypatch: Any) -> Iterator[None]:
    """transformers' ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` made to follow the history it
    is called on, as genkit's does. transformers' feeds the last token of every call's ``input_ids``
    to its unconditional branch and never rolls it back: under assisted decoding it is called on each
    drafted position of a round (and by prompt lookup's check of forbidden tokens, and by the
    assistant's own drafting), so the rejected drafts stay in the branch and the guidance differs
    from plain decoding's (the evidence: tests/test_sliding_window_rollback.py). Patched: each call
    runs the branch on the negative prompt followed by the tokens the call's ``input_ids`` hold
    after the prompt (the first call's length), without a cache. Plain decoding gives the same
    scores either way."""
    def unconditional_logits(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
        context = self.unconditional_context
        if context["first_pass"]:
            if context["input_ids"] is None:
                context["input_ids"] = input_ids[:, -1:]
            if context["attention_mask"] is None:
                context["attention_mask"] = torch.ones_like(context["input_ids"], dtype=torch.long)
            context["prompt_length"], context["first_pass"] = input_ids.shape[1], False
        generated = input_ids[:, context["prompt_length"]:]
        ids = torch.cat([context["input_ids"], generated], dim=1)
        mask = torch.cat([context["attention_mask"], torch.ones_like(generated)], dim=1)
        return self.model(ids, attention_mask=mask, use_cache=False).logits

    with monkeypatch.context() as m:
        m.setattr(LP.UnbatchedClassifierFreeGuidanceLogitsProcessor, "get_unconditional_logits", unconditional_logits)
        yield
