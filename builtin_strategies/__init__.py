"""genkit's built-in plugin: strategies, logits processors, candidate generators and streamers.

Registered at start-up through the same hooks as any pack. Every item is given as a
``"module:attr"`` string so that discovery imports no torch; the module is imported on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from genkit.hookspecs import hookimpl

from . import fields as F

_S = "genkit.builtin_strategies"


def _is_greedy(config: Any) -> bool:
    return config.num_beams == 1 and not config.do_sample


def _is_sample(config: Any) -> bool:
    return config.num_beams == 1 and bool(config.do_sample)


def _is_assisted(config: Any) -> bool:
    """An assistant model, prompt lookup or a named candidate generator, with a single beam."""
    return config.num_beams == 1 and (getattr(config, "assistant_model", None) is not None
                                      or config.prompt_lookup_num_tokens is not None
                                      or config.candidate_generator is not None)


def _is_contrastive(config: Any) -> bool:
    """``penalty_alpha`` > 0 with ``top_k`` > 1 candidates, greedy, one beam (as in transformers)."""
    alpha, top_k = config.penalty_alpha, config.top_k
    return (config.num_beams == 1 and not config.do_sample and alpha is not None and alpha > 0
            and top_k is not None and top_k > 1)


def _is_dola(config: Any) -> bool:
    return config.num_beams == 1 and config.dola_layers is not None


def _is_early_exit(config: Any) -> bool:
    return config.num_beams == 1 and config.assistant_early_exit is not None


@hookimpl
def register_strategies(register: Callable[..., None]) -> None:
    register("greedy", f"{_S}.decoding:greedy_search", applies=_is_greedy, priority=0,
             description="Greedy search: the most likely token at each step.")
    register("sample", f"{_S}.decoding:sample", applies=_is_sample, priority=0,
             description="Multinomial sampling from the processed distribution.")
    register("assisted", f"{_S}.assisted:assisted_decoding", applies=_is_assisted, priority=10,
             description="Assisted/speculative decoding: a candidate generator drafts, the model verifies.")
    # beam family (builtin_strategies/beam_*.py): the most specific selector has the highest priority
    register("beam_search", f"{_S}.beam_search:beam_search", applies=f"{_S}.beam_select:is_beam_search",
             priority=10, description="Beam search: keep the num_beams best hypotheses at each step.")
    register("beam_sample", f"{_S}.beam_search:beam_sample", applies=f"{_S}.beam_select:is_beam_sample",
             priority=10, description="Beam-search multinomial sampling.")
    register("group_beam_search", f"{_S}.beam_diverse:group_beam_search",
             applies=f"{_S}.beam_select:is_group_beam_search", priority=20,
             description="Diverse (group) beam search with a Hamming diversity penalty.")
    register("constrained_beam_search", f"{_S}.beam_constraints:constrained_beam_search",
             applies=f"{_S}.beam_select:is_constrained_beam_search", priority=30,
             description="Constrained beam search: force_words_ids phrases and disjunctive sets.")
    # above "assisted": an assistant_model given with them is refused rather than winning silently
    register("contrastive_search", f"{_S}.contrastive:contrastive_search", applies=_is_contrastive, priority=12,
             description="Contrastive search: top_k candidates re-ranked by a degeneration penalty (penalty_alpha).")
    register("dola_generation", f"{_S}.dola:dola_decoding", applies=_is_dola, priority=13,
             description="DoLa: contrast the final layer with premature layers (dola_layers).")
    register("assisted_early_exit", f"{_S}.early_exit:assisted_early_exit", applies=_is_early_exit, priority=15,
             description="Self-speculative decoding: the first assistant_early_exit layers draft, the model verifies.")


# (name, factory attribute, fields, order) in transformers' processor order
_PROCESSORS: tuple[tuple[str, str, tuple[Any, ...], int], ...] = (
    # classifier-free guidance first: it turns the model's logits into log-probabilities
    ("guidance", "guidance:make_guidance", (), 10),
    ("sequence_bias", "make_sequence_bias", (F.SEQUENCE_BIAS,), 20),
    ("encoder_repetition_penalty", "make_encoder_repetition_penalty", (F.ENCODER_REPETITION_PENALTY,), 30),
    ("repetition_penalty", "make_repetition_penalty", (F.REPETITION_PENALTY,), 40),
    ("presence_frequency_penalty", "make_presence_frequency_penalty", (F.PRESENCE_PENALTY, F.FREQUENCY_PENALTY), 45),
    ("no_repeat_ngram", "make_no_repeat_ngram", (F.NO_REPEAT_NGRAM_SIZE,), 50),
    ("encoder_no_repeat_ngram", "make_encoder_no_repeat_ngram", (F.ENCODER_NO_REPEAT_NGRAM_SIZE,), 60),
    ("bad_words", "make_bad_words", (F.BAD_WORDS_IDS,), 70),
    ("min_length", "make_min_length", (), 80),
    ("min_new_tokens", "make_min_new_tokens", (), 90),
    ("prefix_allowed_tokens", "make_prefix_allowed_tokens", (), 100),
    ("forced_bos", "make_forced_bos", (F.FORCED_BOS,), 110),
    ("forced_eos", "make_forced_eos", (F.FORCED_EOS,), 120),
    ("remove_invalid_values", "make_remove_invalid_values", (F.REMOVE_INVALID,), 130),
    ("exponential_decay_length_penalty", "make_exponential_decay_length_penalty", (F.DECAY,), 140),
    ("suppress_tokens", "make_suppress_tokens", (F.SUPPRESS,), 150),
    ("begin_suppress_tokens", "make_begin_suppress_tokens", (F.BEGIN_SUPPRESS,), 160),
    # structured outputs: the grammar's mask before the warpers, so they see only allowed tokens
    ("structured_output", "structured:make_structured_output", F.STRUCTURED, 170),
    ("temperature", "make_temperature", (F.TEMPERATURE,), 200),
    ("top_h", "make_top_h", (F.TOP_H,), 205),
    ("top_k", "make_top_k", (F.TOP_K,), 210),
    ("top_p", "make_top_p", (F.TOP_P,), 220),
    ("min_p", "make_min_p", (F.MIN_P,), 230),
    ("typical_p", "make_typical_p", (F.TYPICAL_P,), 240),
    ("epsilon_cutoff", "make_epsilon_cutoff", (F.EPSILON_CUTOFF,), 250),
    ("eta_cutoff", "make_eta_cutoff", (F.ETA_CUTOFF,), 260),
    # after every other processor and warper (transformers #34630), before the renormalisation
    ("watermark", "watermark:make_watermark", (), 900),
    ("renormalize_logits", "make_renormalize", (F.RENORMALIZE_LOGITS,), 1000),
)


@hookimpl
def register_logits_processors(register: Callable[..., None]) -> None:
    for name, factory, fields, order in _PROCESSORS:
        target = f"{_S}.{factory}" if ":" in factory else f"{_S}.processor_factories:{factory}"
        register(name, target, fields=fields, order=order)


@hookimpl
def register_candidate_generators(register: Callable[..., None]) -> None:
    register("prompt_lookup", f"{_S}.candidates:prompt_lookup",
             description="N-gram lookup in the prompt and the generated text (prompt lookup decoding).")
    register("draft_model", f"{_S}.candidates:draft_model",
             description="A smaller assistant model drafts with its own cache (speculative decoding).")
    register("universal_assisted", f"{_S}.candidates_universal:universal_assisted",
             description="An assistant model with its own tokenizer drafts; drafts are re-encoded as text "
                         "(universal assisted decoding).")


@hookimpl
def register_streamers(register: Callable[..., None]) -> None:
    register("text", f"{_S}.streamers:TextStreamer", description="Print decoded text to stdout as it arrives.")
    register("iterator", f"{_S}.streamers:TextIteratorStreamer",
             description="Iterate over decoded text from another thread.")
    register("async_iterator", f"{_S}.streamers:AsyncTextIteratorStreamer",
             description="Async-iterate over decoded text.")


@hookimpl
def register_watermarks(register: Callable[..., None]) -> None:
    register("greenlist", "genkit.watermarking:WatermarkingConfig",
             description="The green-list watermark of Kirchenbauer et al. (transformers' WatermarkingConfig).")


@hookimpl
def register_schedulers(register: Callable[..., None]) -> None:
    register("fifo", "genkit.continuous.scheduler:FIFOScheduler",
             description="Decoding requests first, then prompts in arrival order, with a cache safety margin.")
    register("prefill_first", "genkit.continuous.scheduler:PrefillFirstScheduler",
             description="Prompts first (split prefills, then new requests), then decoding requests.")
