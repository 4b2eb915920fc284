"""Rules across fields: combinations that are errors (:func:`check_combinations`) and flags that
have no effect with the rest of the config (:func:`minor_issues`, warned about according to where
each value came from)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, NotSupportedError
from ..plugins import FieldSpec
from .fields import EXTRA_OUTPUT_FLAGS, INT64_MAX, field_table, is_int, is_num, past_int64, token_id_fields
from .warn import warn_once

if TYPE_CHECKING:
    from .generation_config import GenerationConfig


def should_warn(outer: str, inner: str, user_set: set[str] | None) -> bool:
    """Warn about ``inner`` (e.g. ``top_p``) having no effect because of ``outer`` (e.g.
    ``do_sample``) unless the caller set ``outer`` and ``inner`` came from somewhere else (the
    model's generation config): a model's sampling defaults are harmless when the caller asks for
    greedy decoding. ``user_set=None`` counts everything as set by the caller."""
    if user_set is None:
        return True
    return not (outer in user_set and inner not in user_set)



# the smallest temperature sampling takes (vLLM's _SAMPLING_EPS, below which it decodes greedily)
MIN_SAMPLING_TEMPERATURE = 1e-5


def _value(c: GenerationConfig, name: str) -> Any:
    """The value generate would use: the field's, or its default when unset."""
    value = getattr(c, name)
    if value is None:
        spec = field_table().get(name)
        return spec.default if spec is not None else None
    return value


def check_combinations(c: GenerationConfig) -> None:
    v = lambda name: _value(c, name)  # noqa: E731
    if c.max_length is not None and c.min_length is not None and c.max_new_tokens is None \
            and c.min_length > c.max_length:
        raise ConfigError(f"`min_length` ({c.min_length}) must be <= `max_length` ({c.max_length}).")
    if c.max_new_tokens is not None and c.min_new_tokens is not None and c.min_new_tokens > c.max_new_tokens:
        raise ConfigError(
            f"`min_new_tokens` ({c.min_new_tokens}) must be <= `max_new_tokens` ({c.max_new_tokens})."
        )
    if v("do_sample") and is_num(c.temperature) and c.temperature <= 0:
        raise ConfigError(
            f"`temperature` must be a number > 0 when do_sample=True; got {c.temperature!r}. "
            "For greedy decoding set do_sample=False."
        )
    if v("do_sample") and is_num(c.temperature) and 0 < c.temperature < MIN_SAMPLING_TEMPERATURE:
        # logits divided by it overflow to inf, then softmax gives NaN (vLLM reads such a value as greedy)
        raise ConfigError(
            f"`temperature` must be >= {MIN_SAMPLING_TEMPERATURE} when do_sample=True; got {c.temperature!r}: a "
            "smaller one overflows the scaled logits. For greedy decoding set do_sample=False."
        )
    beams, groups, returned = v("num_beams"), v("num_beam_groups"), v("num_return_sequences")
    if beams % groups != 0:
        raise ConfigError(f"`num_beams` ({beams}) must be divisible by `num_beam_groups` ({groups}).")
    if groups > 1 and v("do_sample"):
        raise ConfigError("`num_beam_groups` > 1 (diverse beam search) requires do_sample=False.")
    if beams > 1 and returned > beams:
        raise ConfigError(f"`num_return_sequences` ({returned}) must be <= `num_beams` ({beams}).")
    if beams == 1 and not v("do_sample") and returned > 1:
        raise ConfigError(
            f"`num_return_sequences` ({returned}) > 1 needs do_sample=True or num_beams > 1; "
            "greedy search returns one sequence per prompt."
        )
    for name in ("force_words_ids", "constraints"):
        if getattr(c, name) and (v("do_sample") or beams == 1):
            raise ConfigError(f"`{name}` (constrained beam search) needs num_beams > 1 and do_sample=False.")
    _check_forced_not_suppressed(c)
    _check_layer_strategies(c)
    if c.guidance_scale is not None and c.guidance_scale != 1 and beams > 1:
        raise NotSupportedError("`guidance_scale` (classifier-free guidance) works with greedy search, sampling and "
                                f"assisted decoding; not with beam search: num_beams={beams!r}")


# special tokens a model's own config may hold outside its vocabulary: transformers' configs keep
# their defaults when a test model shrinks the vocabulary (GPT2Config(vocab_size=64) keeps GPT-2's
# 50256), and transformers generates with them; what each means then
MODEL_SPECIAL_TOKENS = {
    "eos_token_id": "it never ends a row",
    "pad_token_id": "rows that finish early are padded with the first EOS id inside it, else 0",
    "bos_token_id": "a generation without a prompt cannot start from it",
    "decoder_start_token_id": "the decoder cannot start from it",
}


def model_vocab_size(model: Any) -> int | None:
    """The width of a model's logits, the vocabulary it generates from: its decoder's config's
    (an encoder-decoder model's ``config.decoder`` or ``decoder_vocab_size``, a multimodal model's
    text config), not its tokenizer's length (a head may be padded past the tokenizer, or a
    tokenizer know more ids than the head scores); ``None`` when its config does not say."""
    model_config = getattr(model, "config", None)
    get_text_config = getattr(model_config, "get_text_config", None)
    text = get_text_config(decoder=True) if callable(get_text_config) else model_config
    for key in ("decoder_vocab_size", "vocab_size"):
        vocab = getattr(text, key, None)
        if is_int(vocab) and vocab > 0:
            return int(vocab)
    return None


def model_token_issue(name: str, ids: list[int], vocab_size: int) -> str:
    """The warning about a model's special token outside its vocabulary (:data:`MODEL_SPECIAL_TOKENS`)."""
    return (f"the model's `{name}` holds token ids {ids[:8]} outside its vocabulary (size {vocab_size}): "
            f"{MODEL_SPECIAL_TOKENS[name]}")


def check_vocabulary(c: GenerationConfig, vocab_size: int | None) -> None:
    """Every token id a field holds (the fields whose :class:`~genkit.plugins.FieldSpec` lists its
    ``token_ids``: the special tokens, ``suppress_tokens``, ``bad_words_ids``, ``sequence_bias``, a
    pack's) is an int64, whoever set it (a ``ConfigError`` naming the field, the model's own
    special tokens included: no tensor can hold it), and lies below ``vocab_size`` (when known), the
    width of the model's logits: a ``ConfigError`` naming the field and the vocabulary otherwise (an
    id the model can never score would be ignored, or fail in the middle of a generation). The one
    exception: a special token of :data:`MODEL_SPECIAL_TOKENS` the caller did not set (a resolved
    config's ``user_set``; the model's) is warned about. Negative ids are the fields' own business
    (the "matches no token" sentinel of ``eos_token_id`` / ``pad_token_id``)."""
    user_set = getattr(c, "user_set", None)
    for name, token_ids in token_id_fields():
        value = getattr(c, name, None)
        if value is None:
            continue
        ids = [int(i) for i in token_ids(value) if is_int(i)]
        wide = past_int64(ids)
        if wide:
            whose = "the model's " if name in MODEL_SPECIAL_TOKENS and user_set is not None and name not in user_set \
                else ""
            top = INT64_MAX if vocab_size is None else vocab_size - 1
            raise ConfigError(f"{whose}`{name}` holds token ids {wide[:8]} outside the int64 range; accepted ids are "
                              f"0..{top}")
        too_big = sorted({i for i in ids if vocab_size is not None and i >= vocab_size})
        if not too_big or vocab_size is None:
            continue
        if name in MODEL_SPECIAL_TOKENS and user_set is not None and name not in user_set:
            warn_once(model_token_issue(name, too_big, vocab_size))
            continue
        raise ConfigError(outside_vocabulary(name, too_big, vocab_size))


def outside_vocabulary(name: str, ids: list[int], vocab_size: int) -> str:
    """The message for token ids of ``name`` the model's logits (``vocab_size`` wide) cannot hold."""
    return (f"`{name}` holds token ids {ids[:8]} outside the model's vocabulary (size {vocab_size}); "
            f"accepted ids are 0..{vocab_size - 1}")


def _check_forced_not_suppressed(c: GenerationConfig) -> None:
    """A token both forced and suppressed gives all -inf logits, then NaN (transformers' check)."""
    suppressed = getattr(c, "suppress_tokens", None)
    if not suppressed:
        return
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = getattr(c, name, None)
        if forced is None:
            continue
        forced_set = {forced} if isinstance(forced, int) else set(forced)
        if forced_set and forced_set <= set(suppressed):
            raise ConfigError(
                f"every token in `{name}` ({sorted(forced_set)}) is also in `suppress_tokens`: forcing a token "
                f"while suppressing it leaves no token to generate. Remove it from one of the two (to prevent "
                "an early EOS, use `min_new_tokens`)."
            )


def _check_layer_strategies(c: GenerationConfig) -> None:
    """Contrastive search, DoLa and early exit: each needs its companion settings, and none of them
    combines with beams, with each other or with a draft source (one would be ignored). Checked with
    the config rather than once the strategy runs (``genkit serve`` answers a 400 naming the field,
    not an error event in a stream): contrastive search, drafting and early exit keep entries in the
    model's cache (``use_cache``); drafting and early exit verify one sequence (``num_return_sequences``)."""
    v = lambda name: _value(c, name)  # noqa: E731
    contrastive = c.penalty_alpha is not None and c.penalty_alpha > 0
    if contrastive and not (is_int(v('top_k')) and v('top_k') > 1):
        raise ConfigError(f"`penalty_alpha` > 0 (contrastive search) needs `top_k` > 1 candidates per step; got "
                          f"top_k={v('top_k')!r}. Set top_k (e.g. 4), or penalty_alpha=None for greedy search.")
    if contrastive and (v('do_sample') or v('num_beams') != 1):
        raise ConfigError("`penalty_alpha` (contrastive search) is deterministic and single-beam: it needs "
                          f"do_sample=False and num_beams=1; got do_sample={v('do_sample')!r}, num_beams={v('num_beams')!r}.")
    if c.low_memory and not contrastive:
        raise ConfigError("`low_memory=True` only changes contrastive search (penalty_alpha > 0, top_k > 1); "
                          "accepted otherwise: False or None.")
    chosen = [name for name, on in (("penalty_alpha", contrastive), ("dola_layers", c.dola_layers is not None),
                                    ("assistant_early_exit", c.assistant_early_exit is not None)) if on]
    drafts = [n for n in ("prompt_lookup_num_tokens", "candidate_generator") if getattr(c, n) is not None]
    if len(chosen) > 1 or (chosen and drafts):
        raise ConfigError(f"{' and '.join(f'`{n}`' for n in chosen + drafts)} select different strategies; set one "
                          "of them.")
    if (chosen or drafts) and v('num_beams') != 1:  # (transformers warns and drops the setting)
        raise ConfigError(f"`{(chosen + drafts)[0]}` works with num_beams=1; got num_beams={v('num_beams')!r}.")
    cached = [n for n in chosen if n != "dola_layers"] + drafts  # (DoLa runs without the cache)
    if c.use_cache is False and cached:
        raise ConfigError(f"`use_cache` must be True (or unset) with `{cached[0]}`: that strategy keeps entries in "
                          "the model's cache")
    one_row = [n for n in chosen if n == "assistant_early_exit"] + drafts
    if one_row and v("num_return_sequences") != 1:
        raise NotSupportedError(f"`{one_row[0]}` (assisted decoding) returns one sequence per prompt: "
                                f"`num_return_sequences` must be 1; got {v('num_return_sequences')!r}")


# the fields that act only when sampling (the warpers), each with the value that leaves the
# distribution as it is; genkit serve: a request that sets one samples
SAMPLING_FLAGS = (("temperature", 1.0), ("top_p", 1.0), ("min_p", None), ("top_h", None), ("typical_p", 1.0),
                  ("top_k", 50), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0))


def negative_pad_issue(pad: Any) -> str | None:
    """The warning for a negative ``pad_token_id`` (transformers' "matches no token" sentinel: a
    minor issue there too, refused when saving), ``None`` for any other value."""
    if not is_int(pad) or pad >= 0:
        return None
    return (f"`pad_token_id` should be a token id >= 0, but is {pad!r}: a negative id is no token, so genkit "
            "treats it as unset (rows that finish early are padded with the first EOS id, else 0).")


def minor_issues(c: GenerationConfig, table: dict[str, FieldSpec], user_set: set[str] | None) -> list[str]:
    """Flags that have no effect with the rest of the config (transformers 5's list, same
    provenance rule)."""
    issues = []
    if c.do_sample is not True:
        for name, off in SAMPLING_FLAGS:
            value = getattr(c, name, None)
            if name == "top_k" and c.penalty_alpha:  # contrastive search's candidates per step
                continue
            if name in table and value is not None and value != off and should_warn("do_sample", name, user_set):
                issues.append(f"`{name}` is set to {value!r} but `do_sample` is not True, so it has no effect "
                              f"(set do_sample=True or unset `{name}`).")
    if c.num_beams is None or c.num_beams == 1:
        for name, off in (("early_stopping", False), ("length_penalty", 1.0)):
            value = getattr(c, name)
            if value is not None and value != off and should_warn("num_beams", name, user_set):
                issues.append(f"`{name}` is set to {value!r} but it only applies to beam search (num_beams > 1), "
                              "so it has no effect.")
    if (c.num_beam_groups is None or c.num_beam_groups == 1) and c.diversity_penalty not in (None, 0.0) \
            and should_warn("num_beam_groups", "diversity_penalty", user_set):
        issues.append("`diversity_penalty` only applies to diverse beam search (num_beam_groups > 1), "
                      "so it has no effect.")
    if c.use_cache is False:
        for name in ("cache_implementation", "cache_config"):
            if getattr(c, name) is not None:
                issues.append(f"`{name}` is set but `use_cache` is False, so it has no effect.")
    if c.return_dict_in_generate is not True:
        for name in EXTRA_OUTPUT_FLAGS:
            if getattr(c, name) is True:
                issues.append(f"`{name}` is True but `return_dict_in_generate` is not, so generate returns only "
                              f"the sequences and `{name}` has no effect.")
    pad = negative_pad_issue(c.pad_token_id)
    return issues + [pad] if pad else issues

