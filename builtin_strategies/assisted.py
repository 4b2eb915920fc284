"""Assisted (speculative) decoding: a candidate generator drafts, the target verifies.

Each round the candidate generator proposes ``k`` tokens; one forward pass of the target over the
last accepted token plus the ``k`` candidates yields ``k + 1`` next-token distributions. The
logits processors are applied position by position exactly as plain decoding would apply them.

- **Greedy** (``do_sample=False``): the candidates are accepted up to the first one that differs
  from the target's argmax, and the target's own token at that position is appended, so the output
  equals greedy decoding token for token.
- **Sampling** (``do_sample=True``): the speculative sampling rule — candidate ``x`` with draft
  probability ``q(x)`` is accepted with probability ``min(1, p(x) / q(x))``; on the first rejection a
  token is drawn from ``max(0, p - q)`` renormalised; when every candidate is accepted one more
  token is drawn from ``p``. A generator without draft scores (n-gram lookup) counts as a draft that
  puts all its mass on its candidate. The output follows the target's distribution.

The target's cache is rolled back with ``crop()`` after each round (a cache with sliding-window
layers keeps what the round added until then: ``Stepper.rollback``). Stopping criteria are checked
after every accepted token, so EOS, ``max_length`` and custom criteria end the output where plain
decoding would. Drafted tokens past ``max_length`` could never be kept and are not verified; a
sampled draft without scores still takes the random numbers of its whole length, as transformers
(which verifies it whole) does. Batch size 1 (as in transformers).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from genkit.errors import NotSupportedError, PluginError
from genkit.strategy import (
    ConfigError,
    FinishTracker,
    GenerateDecoderOnlyOutput,
    StepOutputs,
    Stepper,
    StrategyCall,
    check_choosable,
)

logger = logging.getLogger("genkit.assisted")

__all__ = ["applies", "assisted_decoding", "build_candidate_generator", "verify_round"]


def applies(config: Any) -> bool:
    """Selector: an assistant model, ``prompt_lookup_num_tokens`` or ``candidate_generator`` is set
    (single-beam decoding only). The registry uses the torch-free copy in ``builtin_strategies``."""
    from . import _is_assisted

    return _is_assisted(config)


def build_candidate_generator(model: Any, config: Any, *, assistant_model: Any = None,
                              logits_processor: Any = None, tokenizer: Any = None,
                              assistant_tokenizer: Any = None) -> Any:
    """The candidate generator the config asks for.

    ``candidate_generator`` (a registered name) wins; otherwise ``prompt_lookup_num_tokens`` means
    ``"prompt_lookup"`` (even with an assistant model, as in transformers 5: the assistant is then
    unused, and a warning says so), an assistant model with ``assistant_tokenizer`` means
    ``"universal_assisted"`` and an assistant model alone ``"draft_model"``. The user's
    ``candidate_generator_kwargs`` go to the factory as keywords; the ``tokenizer=`` and
    ``assistant_tokenizer=`` given to ``generate`` go too unless those kwargs name them, for a
    factory that takes them.
    """
    from genkit.plugins import get_registry

    name = config.candidate_generator
    if name is None:
        if config.prompt_lookup_num_tokens is not None:
            name = "prompt_lookup"
            if assistant_model is not None:
                logger.warning("`prompt_lookup_num_tokens` is set: drafts come from prompt lookup and "
                               "`assistant_model` is not used (as in transformers 5)")
        elif assistant_model is not None:
            name = "universal_assisted" if assistant_tokenizer is not None else "draft_model"
        else:
            raise ConfigError(
                 "assisted decoding needs a draft source: pass `assistant_model=`, set "
                 "`prompt_lookup_num_tokens`, or set `candidate_generator` to a registered name"
             )
    factory = get_registry().get("candidate_generator", name).load()
    user_kwargs = dict(config.candidate_generator_kwargs or {})
    for key, value in (("tokenizer", tokenizer), ("assistant_tokenizer", assistant_tokenizer)):
        if value is not None and key not in user_kwargs and _takes_keyword(factory, key):
            user_kwargs[key] = value
    generator = factory(model, config, assistant_model=assistant_model, logits_processor=logits_processor,
                        **user_kwargs)
    for method in ("get_candidates", "update_candidate_strategy"):
        if not callable(getattr(generator, method, None)):
            raise PluginError(f"candidate generator {name!r} returned {type(generator).__name__}, "
                              f"which has no `{method}` method")
    return generator


def _takes_keyword(factory: Any, name: str) -> bool:
    """Whether ``factory`` names the keyword parameter ``name`` (``**kwargs`` does not count: a
    factory may refuse keywords it does not know)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def assisted_decoding(model: Any, input_ids: torch.Tensor, **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Generate with drafts from a candidate generator, verified by ``model`` (see module doc)."""
    call = StrategyCall.from_kwargs("the assisted strategy", model, input_ids,
                                    accept=("assistant_model", "assistant_tokenizer"), **kwargs)
    call.refuse("position_ids")
    if call.config.num_return_sequences != 1:
        raise NotSupportedError(f"assisted decoding returns one sequence: `num_return_sequences` must be 1; got "
                                f"{call.config.num_return_sequences}")
    if call.batch != 1:
        raise NotSupportedError(f"assisted decoding supports batch size 1; got input_ids with batch size {call.batch}")
    if not call.use_cache:
        raise ConfigError("assisted decoding needs the target's cache: `use_cache` must be True")
    generator = build_candidate_generator(model, call.config, assistant_model=call.extras["assistant_model"],
                                          logits_processor=call.logits_processor, tokenizer=call.tokenizer,
                                          assistant_tokenizer=call.extras["assistant_tokenizer"])
    record = StepOutputs(call.config)
    # refuses a passed cache that already holds the whole prompt
    stepper = Stepper(call, output_hidden_states=record.want_hidden)
    rounds = drafted_total = accepted_total = 0
    with FinishTracker(call) as finish, stepper.rollback():  # the first forward already holds a draft
        done = False
        while not done:
            cur = stepper.length
            candidates, candidate_logits, drafted = _draft(generator, stepper.sequences, call.max_length - cur - 1)
            k = candidates.shape[1]
            if k:
                stepper.push(candidates)
            n_matches, kept, done, new_scores = verify_round(call, stepper, finish, record, candidates,
                                                             candidate_logits, cur, first_round=rounds == 0,
                                                             drafted=drafted)
            rounds += 1
            drafted_total += k
            accepted_total += min(n_matches, kept)
            # every round, the last one too, as transformers does (a "heuristic" count carries over)
            generator.update_candidate_strategy(stepper.sequences, torch.stack(new_scores, dim=1), n_matches)
    logger.debug("assisted decoding: %d rounds, %d drafted, %d accepted", rounds, drafted_total, accepted_total)
    out = record.as_tuples()
    return GenerateDecoderOnlyOutput(sequences=stepper.sequences, scores=out["scores"], logits=out["logits"],
                                     hidden_states=out["hidden_states"], attentions=out["attentions"],
                                     cross_attentions=out["cross_attentions"], past_key_values=stepper.cache,
                                     finish_reasons=finish.reasons)


def _hidden_for(hidden: tuple[torch.Tensor, ...] | None, index: int, *,
                whole_prompt: bool) -> tuple[torch.Tensor, ...] | None:
    """Each layer's hidden state at position ``index`` of the last forward's input (the position
    whose logits chose a token), as plain decoding records it: for the first token, every prompt
    position up to it (``whole_prompt``); one position after that."""
    if hidden is None:
        return None
    if whole_prompt:
        return tuple(h[:, :index + 1] for h in hidden)
    return tuple(h[:, index:index + 1] for h in hidden)


def _attentions_for(attentions: tuple[Any, Any] | None, index: int, keys: int, *,
                    whole_prompt: bool) -> tuple[Any, Any] | None:
    """Each layer's attention weights of the query at ``index`` of the last forward's input over
    its first ``keys`` keys (the drafted tokens after it left out), and an encoder-decoder
    decoder's cross-attentions of that query, as plain decoding records them: for the first token,
    every prompt query up to it (``whole_prompt``)."""
    if attentions is None:
        return None
    start = 0 if whole_prompt else index
    own, cross = attentions
    return (tuple(a[:, :, start:index + 1, :keys] for a in own),
            None if cross is None else tuple(c[:, :, start:index + 1] for c in cross))


def verify_round(call: StrategyCall, stepper: Stepper, finish: FinishTracker, record: StepOutputs,
                 candidates: torch.Tensor, candidate_logits: torch.Tensor | None,
                 cur: int, *, first_round: bool = False,
                 drafted: int | None = None) -> tuple[int, int, bool, list[torch.Tensor]]:
    """One target pass over the tokens the cache lacks, ending with the ``k`` candidates ``(1, k)``
    already pushed after ``cur`` tokens; keep the accepted candidates and the target's own next token.
    ``drafted``: the draft's length before ``max_length`` cut it to ``k`` (the random draws are
    transformers', which verifies the whole draft). Returns (candidates accepted, tokens kept,
    done, the ``k + 1`` processed score rows)."""
    k = candidates.shape[1]
    fed_from = stepper.length - stepper.pending
    logits = stepper.forward(keep=k + 1)
    # processors position by position, on the prefix each position would see
    new_scores = [call.logits_processor(stepper.ids[:, :cur + i], logits[:, i].clone()) for i in range(k + 1)]
    n_matches, next_token = _verify(candidates, candidate_logits, new_scores, bool(call.config.do_sample),
                                    k if drafted is None else drafted)
    kept, done = _accept(stepper, finish, candidates[:, :n_matches], next_token, new_scores, cur)
    for i in range(kept):
        index, whole_prompt = cur - 1 + i - fed_from, first_round and i == 0
        record.model_step(logits[:, i], _hidden_for(stepper.hidden_states, index, whole_prompt=whole_prompt),
                          _attentions_for(stepper.attentions, index, cur + i, whole_prompt=whole_prompt))
        record.processed(new_scores[i])
    return n_matches, kept, done, new_scores


def _draft(generator: Any, seqs: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """At most ``room`` drafted tokens ``(1, k)`` after ``seqs``, their draft logits (or None) and
    how many tokens the generator drafted (``k`` or more: tokens past ``max_length`` are never kept,
    so they are not verified)."""
    candidate_ids, candidate_logits = generator.get_candidates(seqs)
    candidates = candidate_ids[:, seqs.shape[1]:].to(seqs.device)
    drafted = candidates.shape[1]
    if candidates.shape[1] > room:
        candidates = candidates[:, :room]
        if candidate_logits is not None:
            candidate_logits = candidate_logits[:, :room]
    return candidates, candidate_logits, drafted


def _verify(candidates: torch.Tensor, candidate_logits: torch.Tensor | None, new_scores: list[torch.Tensor],
            do_sample: bool, drafted: int) -> tuple[int, int]:
    """How many candidates the target accepts, and its own next token after them. A target position
    the processors left no token at raises, as the sampler does (:func:`~genkit.strategy.check_choosable`)."""
    if do_sample:
        try:
            return _speculative_accept(candidates, candidate_logits, new_scores, drafted=drafted)
        except RuntimeError:  # NaN probabilities: a position with no token allowed?
            scores = torch.cat(new_scores, dim=0)
            check_choosable(scores, scores.argmax(dim=-1))
            raise
    k = candidates.shape[1]
    chosen = torch.stack([s.argmax(dim=-1) for s in new_scores], dim=1)  # (1, k + 1)
    agree = (chosen[0, :k] == candidates[0]).long()
    n_matches = int(agree.cumprod(0).sum()) if k else 0
    for i in range(n_matches + 1):  # the positions whose tokens are kept (no copy of their scores)
        check_choosable(new_scores[i], chosen[:, i])
    return n_matches, int(chosen[0, n_matches])


def _accept(stepper: Stepper, finish: FinishTracker, accepted: torch.Tensor, next_token: int,
            new_scores: list[torch.Tensor], cur: int) -> tuple[int, bool]:
    """Keep the ``accepted`` candidates ``(1, n)`` (already in the sequences, after ``cur`` tokens)
    and the target's ``next_token``, checking the stop conditions after each token as plain decoding
    would. Returns (tokens kept, done). The cache keeps every kept token but the newest."""
    n = accepted.shape[1]
    for i in range(n):
        if finish.update(stepper.ids[:, :cur + i + 1], new_scores[i], accepted[:, i]):
            stepper.crop(cur + i)
            stepper.push(accepted[:, i])
            return i + 1, True
    stepper.crop(cur + n)
    token = accepted.new_tensor([next_token])
    stepper.push(token)
    return n + 1, finish.update(stepper.sequences, new_scores[n], token)


def _speculative_accept(candidates: torch.Tensor, candidate_logits: torch.Tensor | None,
                        new_scores: list[torch.Tensor], *, drafted: int | None = None) -> tuple[int, int]:
    """Speculative sampling acceptance; returns (accepted candidates, the extra token).

    The random draws are transformers 5's, in its order, so a seed gives its tokens: with draft
    scores, one uniform number per candidate at once (``rand_like`` of the ``k`` ratios
    ``p(x) / q(x)``; a candidate is accepted while its number is at most its ratio), then one draw
    from ``max(0, p - q)`` renormalised (from ``p`` after ``k`` acceptances). Without draft scores
    (n-gram lookup: a draft with all its mass on its candidate) a token is drawn from ``p`` at every
    position at once and the candidates are kept up to the first that differs from its draw, as
    transformers does; the same distribution. A draft that ``max_length`` cut from ``drafted``
    tokens to ``k`` draws ``drafted + 1`` rows all the same, as transformers, which verifies it
    whole (the noise of a row does not depend on the others: the rows past ``k`` only take their
    share of the random numbers, and what they would keep lies past ``max_length``)."""
    k = candidates.shape[1]
    p = torch.softmax(torch.cat(new_scores, dim=0), dim=-1)  # (k + 1, vocab): the target's distributions
    if candidate_logits is None:
        rows = p if drafted is None or drafted <= k else torch.cat([p, p[k:].expand(drafted - k, -1)])
        drawn = torch.multinomial(rows, num_samples=1).squeeze(1)[:k + 1]  # (k + 1,)
        agree = (drawn[:k] == candidates[0].to(drawn.device)).long()
        n_matches = int(agree.cumprod(0).sum()) if k else 0
        return n_matches, int(drawn[n_matches])
    q = torch.softmax(candidate_logits[0, :k].float().to(p.device), dim=-1)  # (k, vocab)
    rows, ids = torch.arange(k, device=p.device), candidates[0].to(p.device)
    ratio = p[rows, ids] / q[rows, ids]  # a draft token the draft gave no mass: inf, always accepted
    accepted = torch.rand_like(ratio) <= ratio
    n_matches = int(((~accepted).cumsum(dim=-1) < 1).sum())
    if n_matches == k:
        return k, int(torch.multinomial(p[k], 1))
    residual = (p[n_matches] - q[n_matches]).clamp_min(0)
    total = float(residual.sum())
    dist = residual / total if total > 0 else p[n_matches]
    return n_matches, int(torch.multinomial(dist, 1))
