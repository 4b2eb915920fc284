"""Factories that build the built-in logits processors from a ``GenerationConfig``.

Each ``make_*(config, ctx)`` returns a processor, or ``None`` when the config leaves it off. The
conditions mirror transformers so that the same config builds the same processors in the same
order (the order is the registry's ``order``).
"""

from __future__ import annotations

import logging
from typing import Any

from genkit.strategy.processing import ProcessorContext

from . import logits_process as lp
from .beam_select import is_constrained_beam_search

logger = logging.getLogger("genkit.processors")


def _min_tokens_to_keep(config: Any, ctx: ProcessorContext) -> int:
    # beam sampling keeps at least one non-EOS token per beam
    if config.num_beams > 1:
        return len(ctx.eos_token_ids) + 1 if ctx.eos_token_ids else 2
    return 1


def make_sequence_bias(config: Any, ctx: ProcessorContext) -> Any:
    return lp.SequenceBiasLogitsProcessor(config.sequence_bias) if config.sequence_bias is not None else None


def make_encoder_repetition_penalty(config: Any, ctx: ProcessorContext) -> Any:
    if config.encoder_repetition_penalty in (None, 1.0):  # None: off, as in transformers 5
        return None
    enc = _encoder_ids(ctx)
    if enc is None:
        logger.warning("`encoder_repetition_penalty` needs the encoder's `input_ids`; ignoring it")
        return None
    return lp.EncoderRepetitionPenaltyLogitsProcessor(config.encoder_repetition_penalty, enc)


def _encoder_ids(ctx: ProcessorContext) -> Any:
    """The encoder's token ids (a decoder-only model's prompt), or None when there are none."""
    enc = ctx.encoder_input_ids
    if enc is None or enc.dim() != 2 or bool((enc < 0).any()):
        return None
    return enc


def make_repetition_penalty(config: Any, ctx: ProcessorContext) -> Any:
    if config.repetition_penalty in (None, 1.0):
        return None
    mask = ctx.attention_mask
    padding = (mask != 0).int().argmax(dim=1) if mask is not None else None
    return lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=padding)


def make_presence_frequency_penalty(config: Any, ctx: ProcessorContext) -> Any:
    presence, frequency = config.presence_penalty or 0.0, config.frequency_penalty or 0.0
    if not presence and not frequency:
        return None
    return lp.PresenceFrequencyPenaltyLogitsProcessor(presence, frequency, prompt_length=ctx.input_ids_seq_length)


def make_no_repeat_ngram(config: Any, ctx: ProcessorContext) -> Any:
    n = config.no_repeat_ngram_size
    return lp.NoRepeatNGramLogitsProcessor(n) if n and n > 0 else None


def make_encoder_no_repeat_ngram(config: Any, ctx: ProcessorContext) -> Any:
    n = config.encoder_no_repeat_ngram_size
    if not n:
        return None
    enc = _encoder_ids(ctx)
    if enc is None:
        logger.warning("`encoder_no_repeat_ngram_size` needs the encoder's `input_ids`; ignoring it")
        return None
    return lp.EncoderNoRepeatNGramLogitsProcessor(n, enc)


def make_bad_words(config: Any, ctx: ProcessorContext) -> Any:
    if config.bad_words_ids is None:
        return None
    return lp.NoBadWordsLogitsProcessor(config.bad_words_ids, ctx.eos_token_ids)


def _folded_min_length(config: Any, ctx: ProcessorContext) -> bool:
    """generate() folds ``min_new_tokens`` into ``min_length``; the min-new-tokens processor
    already covers that value, so the min-length one is not built for it a second time."""
    return (config.min_new_tokens is not None and config.min_new_tokens > 0
            and config.min_length == ctx.input_ids_seq_length + config.min_new_tokens)


def make_min_length(config: Any, ctx: ProcessorContext) -> Any:
    if not ctx.eos_token_ids or not config.min_length or config.min_length <= 0:
        return None
    if _folded_min_length(config, ctx):
        return None
    return lp.MinLengthLogitsProcessor(config.min_length, ctx.eos_token_ids, device=ctx.device)


def make_min_new_tokens(config: Any, ctx: ProcessorContext) -> Any:
    if not ctx.eos_token_ids or not config.min_new_tokens or config.min_new_tokens <= 0:
        return None
    return lp.MinNewTokensLengthLogitsProcessor(ctx.input_ids_seq_length, config.min_new_tokens,
                                                ctx.eos_token_ids, device=ctx.device)


def make_prefix_allowed_tokens(config: Any, ctx: ProcessorContext) -> Any:
    if ctx.prefix_allowed_tokens_fn is None:
        return None
    return lp.PrefixConstrainedLogitsProcessor(ctx.prefix_allowed_tokens_fn, _beams_per_call(config))


def _beams_per_call(config: Any) -> int:
    """Rows of one prompt in one call of the processors: diverse beam search calls them on one
    group's beams at a time (``num_beams // num_beam_groups`` per prompt, as transformers 4.x built
    this processor); every other strategy, constrained beam search included, on all the beams; and
    greedy search or sampling on each prompt's ``num_return_sequences`` copies (transformers >= 5.24
    counts ``max(num_beams, num_return_sequences)``)."""
    groups = int(config.num_beam_groups)
    if groups > 1 and not is_constrained_beam_search(config):
        return int(config.num_beams) // groups
    return max(int(config.num_beams), int(config.num_return_sequences or 1))


def make_forced_bos(config: Any, ctx: ProcessorContext) -> Any:
    if config.forced_bos_token_id is None:
        return None
    return lp.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id)


def make_forced_eos(config: Any, ctx: ProcessorContext) -> Any:
    if config.forced_eos_token_id is None:
        return None
    return lp.ForcedEOSTokenLogitsProcessor(config.max_length, config.forced_eos_token_id, device=ctx.device)


def make_remove_invalid_values(config: Any, ctx: ProcessorContext) -> Any:
    return lp.InfNanRemoveLogitsProcessor() if config.remove_invalid_values else None


def make_exponential_decay_length_penalty(config: Any, ctx: ProcessorContext) -> Any:
    decay = config.exponential_decay_length_penalty
    if decay is None or not ctx.eos_token_ids:
        return None
    return lp.ExponentialDecayLengthPenalty(tuple(decay), ctx.eos_token_ids, ctx.input_ids_seq_length)


def make_suppress_tokens(config: Any, ctx: ProcessorContext) -> Any:
    if config.suppress_tokens is None:
        return None
    return lp.SuppressTokensLogitsProcessor(config.suppress_tokens, device=ctx.device)


def make_begin_suppress_tokens(config: Any, ctx: ProcessorContext) -> Any:
    if config.begin_suppress_tokens is None:
        return None
    begin_index = ctx.input_ids_seq_length
    # a forced BOS only shifts the first free step when the prompt is the single start token
    if ctx.input_ids_seq_length <= 1 and config.forced_bos_token_id is not None:
        begin_index += 1
    return lp.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin_index, device=ctx.device)


# -- warpers: only when sampling ---------------------------------------------------------------

def make_temperature(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.temperature in (None, 1.0):
        return None
    return lp.TemperatureLogitsWarper(config.temperature)


def make_top_h(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.top_h is None:
        return None
    return lp.TopHLogitsWarper(config.top_h)


def make_top_k(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or not config.top_k:
        return None
    return lp.TopKLogitsWarper(config.top_k, min_tokens_to_keep=_min_tokens_to_keep(config, ctx))


def make_top_p(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.top_p is None or config.top_p >= 1.0:
        return None
    return lp.TopPLogitsWarper(config.top_p, min_tokens_to_keep=_min_tokens_to_keep(config, ctx))


def make_min_p(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.min_p is None:
        return None
    return lp.MinPLogitsWarper(config.min_p, min_tokens_to_keep=_min_tokens_to_keep(config, ctx))


def make_typical_p(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.typical_p is None or config.typical_p >= 1.0:
        return None
    return lp.TypicalLogitsWarper(config.typical_p, min_tokens_to_keep=_min_tokens_to_keep(config, ctx))


def make_epsilon_cutoff(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.epsilon_cutoff is None or not (0.0 < config.epsilon_cutoff < 1.0):
        return None
    return lp.EpsilonLogitsWarper(config.epsilon_cutoff, min_tokens_to_keep=_min_tokens_to_keep(config, ctx))


def make_eta_cutoff(config: Any, ctx: ProcessorContext) -> Any:
    if not config.do_sample or config.eta_cutoff is None or not (0.0 < config.eta_cutoff < 1.0):
        return None
    return lp.EtaLogitsWarper(config.eta_cutoff, min_tokens_to_keep=_min_tokens_to_keep(config, ctx),
                              device=ctx.device)


def make_renormalize(config: Any, ctx: ProcessorContext) -> Any:
    return lp.LogitNormalization() if config.renormalize_logits else None
