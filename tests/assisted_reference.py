"""transformers 5.24's assisted decoding as the reference for genkit's: four bugs of its draft
model corrected, as the tests that need it say. The first two do not change what the output follows
(the speculative sampling rule keeps the target's distribution whatever the draft proposes, so long
as the draft is drawn from the distribution it reports); they change the drafts, so a seed gives
other tokens. genkit does none of them (its drafts come from the assistant's distribution after the
call's processors, applied once at the target's positions, on the sequence so far; drawn when the
call samples).

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

Two more, of a Whisper assistant only: ``AssistedCandidateGenerator`` calls
``assistant_model.generate``, which for Whisper is ``WhisperGenerationMixin.generate``, not the plain
loop the target runs. Unlike the two above, these change what the output follows.

3. Its drafts are greedy when the call samples. ``generate_with_fallback`` sets ``do_sample`` (and
   ``temperature``) from its own ``temperature`` argument, which the candidate generator never
   passes, so the assistant drafts the argmax while it reports its whole distribution as the scores.
   The speculative sampling rule then accepts a draft ``x`` with ``min(1, p(x) / q(x))`` as if ``x``
   had been drawn from ``q``: the output no longer follows the target's distribution (a model
   assisting itself, ``p = q``, keeps every draft: each round's tokens are its argmax but for the
   one sampled after them).
4. It moves the target's ``begin_suppress_tokens``. Its step 6.5 calls ``set_begin_index(<length of
   the sequence so far>)`` on every processor it is handed, the target's own
   ``SuppressTokensAtBeginLogitsProcessor`` among them: from the first draft on, the target (and the
   assistant) suppress those tokens at the first position of every round instead of the first
   generated one, so greedy assisted decoding no longer gives greedy decoding's tokens.

Whisper's assistant does not have bug 2: ``generate_with_fallback`` sets ``_mask_length``, so its
``_prefill`` reads only the tokens its cache lacks.

:func:`witness` records all four in an unpatched run; :func:`corrected` patches them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.generation import candidate_generator as CG
from transformers.generation import logits_process as LP
from transformers.generation.utils import GenerationMixin
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

# the processors `_get_logits_processor` appends for do_sample=True (after merging the caller's list)
WARPERS = (LP.TemperatureLogitsWarper, LP.TopKLogitsWarper, LP.TopPLogitsWarper, LP.MinPLogitsWarper,
           LP.TypicalLogitsWarper, LP.EpsilonLogitsWarper, LP.EtaLogitsWarper)


@contextmanager
def corrected(monkeypatch: Any) -> Iterator[None]:
    """transformers' assisted decoding with the four bugs patched out (module doc): the assistant gets
    the target's processors without the warpers (its ``generate`` appends them, once, at the same
    place: after the others); an encoder-decoder model's ``_prefill`` on a non-empty cache reads only
    the decoder tokens the cache lacks; a Whisper assistant samples its drafts when the call samples
    (its ``generate`` gets the call's ``temperature``) and leaves the processors' begin index where
    the target set it."""
    init, prefill = CG.AssistedCandidateGenerator.__init__, GenerationMixin._prefill
    whisper_generate = WhisperGenerationMixin.generate

    def init_once_warped(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.logits_processor = [p for p in self.logits_processor if not isinstance(p, WARPERS)]

    def prefill_past_the_cache(self: Any, input_ids: torch.Tensor, generation_config: Any, model_kwargs: dict,
                               *args: Any, **kwargs: Any) -> Any:
        cache = model_kwargs.get("cache")
        if self.config.is_encoder_decoder and cache is not None and cache.get_seq_length() > 0:
            input_ids = input_ids[:, cache.get_seq_length():]
        return prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

    def whisper_drafts_as_asked(self: Any, *args: Any, generation_config: Any = None, temperature: Any = None,
                                **kwargs: Any) -> Any:
        if not getattr(generation_config, "is_assistant", False):
            return whisper_generate(self, *args, generation_config=generation_config, temperature=temperature,
                                    **kwargs)
        if generation_config.do_sample and temperature is None:
            temperature = generation_config.temperature if generation_config.temperature is not None else 1.0
        with monkeypatch.context() as m:
            m.setattr(LP.SuppressTokensAtBeginLogitsProcessor, "set_begin_index", lambda processor, index: None)
            return whisper_generate(self, *args, generation_config=generation_config, temperature=temperature,
                                    **kwargs)

    with monkeypatch.context() as m:
        m.setattr(CG.AssistedCandidateGenerator, "__init__", init_once_warped)
        m.setattr(GenerationMixin, "_prefill", prefill_past_the_cache)
        m.setattr(WhisperGenerationMixin, "generate", whisper_drafts_as_asked)
        yield


@contextmanager
def witness(monkeypatch: Any, assistant: Any) -> Iterator[dict[str, list]]:
    """Records, in an unpatched run, the processors of every ``assistant.generate`` call
    (``"processors"``: their class names; ``"do_sample"``: whether that call's loop samples), each
    forward of ``assistant`` (``"forwards"``: the decoder ids it reads and how many tokens its cache
    held then), and every begin index a ``SuppressTokensAtBeginLogitsProcessor`` of the target's
    (the model that is not ``assistant``) is moved to (``"target_begin_index"``)."""
    seen: dict[str, list] = {"processors": [], "do_sample": [], "forwards": [], "target_begin_index": []}
    get_processors = GenerationMixin._get_logits_processor
    set_begin_index = LP.SuppressTokensAtBeginLogitsProcessor.set_begin_index
    targets: set[int] = set()

    def recording(self: Any, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
        processors = get_processors(self, generation_config, *args, **kwargs)
        if self is assistant:
            seen["processors"].append([type(p).__name__ for p in processors])
            seen["do_sample"].append(bool(generation_config.do_sample))
        else:
            targets.update(id(p) for p in processors)
        return processors

    def moving(processor: Any, index: int) -> None:
        if id(processor) in targets:
            seen["target_begin_index"].append(index)
        set_begin_index(processor, index)

    def pre_forward(module: Any, args: Any, kwargs: dict) -> None:
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        ids = kwargs.get("decoder_input_ids", kwargs.get("input_ids"))
        seen["forwards"].append((ids[0].tolist(), cache.get_seq_length() if cache is not None else 0))

    handle = assistant.register_forward_pre_hook(pre_forward, with_kwargs=True)
    try:
        with monkeypatch.context() as m:
            m.setattr(GenerationMixin, "_get_logits_processor", recording)
            m.setattr(LP.SuppressTokensAtBeginLogitsProcessor, "set_begin_index", moving)
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
