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

The target's cache is rolled back with ``crop()`` after each round. Stopping criteria are checked
after every accepted token, so EOS, ``max_length`` and custom criteria end the output where plain
decoding would. Batch size 1 (as in transformers).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.generation.outputs import GenerateDecoderOnlyOutput
from genkit.generation.processing import StoppingCriteriaList

from .loop_state import mask_buffer, open_cache, read_inputs, uncached_prompt

logger = logging.getLogger("genkit.assisted")

__all__ = ["applies", "assisted_decoding", "build_candidate_generator"]


def applies(config: Any) -> bool:
    """Selector: an assistant model, ``prompt_lookup_num_tokens`` or ``candidate_generator`` is set
    (single-beam decoding only). The registry uses the torch-free copy in ``builtin_strategies``."""
    from . import _is_assisted

    return _is_assisted(config)


def build_candidate_generator(model: Any, config: Any, *, assistant_model: Any = None,
                              logits_processor: Any = None) -> Any:
    """The candidate generator the config asks for.

    ``candidate_generator`` (a registered name) wins; otherwise an assistant model means
    ``"draft_model"`` and ``prompt_lookup_num_tokens`` means ``"prompt_lookup"``. The user's
    ``candidate_generator_kwargs`` go to the factory as keywords.
    """
    from genkit.plugins import get_registry

    name = config.candidate_generator
    if name is None:
        if assistant_model is not None:
            name = "draft_model"
        elif config.prompt_lookup_num_tokens is not None:
            name = "prompt_lookup"
        else:
            raise ValueError(
                "assisted decoding needs a draft source: pass `assistant_model=`, set "
                "`prompt_lookup_num_tokens`, or set `candidate_generator` to a registered name"
            )
    factory = get_registry().get("candidate_generator", name).load()
    user_kwargs = dict(config.candidate_generator_kwargs or {})
    generator = factory(model, config, assistant_model=assistant_model, logits_processor=logits_processor,
                        **user_kwargs)
    for method in ("get_candidates", "update_candidate_strategy"):
        if not callable(getattr(generator, method, None)):
            raise TypeError(f"candidate generator {name!r} returned {type(generator).__name__}, "
                            f"which has no `{method}` method")
    return generator


def assisted_decoding(model: Any, input_ids: torch.Tensor, *, assistant_model: Any = None,
                      **kwargs: Any) -> GenerateDecoderOnlyOutput:
    """Generate with drafts from a candidate generator, verified by ``model`` (see module doc)."""
    run = read_inputs("the assisted strategy", model, input_ids, **kwargs)
    if run.position_ids is not None:
        raise ValueError("unexpected model inputs for the assisted strategy: ['position_ids']")
    cfg, logits_processor, streamer, max_length = run.config, run.logits_processor, run.streamer, run.max_length
    attention_mask, past_key_values, others, eos = run.attention_mask, run.past_key_values, run.others, run.eos
    if run.batch != 1:
        raise ValueError(f"assisted decoding supports batch size 1; got input_ids with batch size {run.batch}")
    if not run.use_cache:
        raise ValueError("assisted decoding needs the target's cache: `use_cache` must be True")
    device = run.device
    do_sample = bool(cfg.do_sample)
    eos_set = set(eos.tolist()) if eos is not None else set()
    generator = build_candidate_generator(model, cfg, assistant_model=assistant_model,
                                          logits_processor=logits_processor)

    mask_buf, _ = mask_buffer(attention_mask, max_length)
    cache = open_cache(model, past_key_values, True, max_length)
    uncached_prompt(input_ids, cache, None)  # refuses a passed cache that already holds the whole prompt
    past = cache.get_seq_length() if cache is not None else 0

    want_scores, want_logits = cfg.output_scores, bool(cfg.output_logits)
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    seqs = input_ids
    if streamer is not None:
        streamer.put(input_ids.cpu())
    rounds = drafted_total = accepted_total = 0

    done = False
    while not done:
        cur = seqs.shape[1]
        candidate_ids, candidate_logits = generator.get_candidates(seqs)
        candidate_ids = candidate_ids.to(device)
        k = candidate_ids.shape[1] - cur
        room = max_length - cur - 1  # the round always adds one token of the target's own
        if k > room:
            candidate_ids = candidate_ids[:, :cur + room]
            if candidate_logits is not None:
                candidate_logits = candidate_logits[:, :room]
            k = room
        candidates = candidate_ids[:, cur:]

        # one target pass over the tokens the cache lacks plus the candidates
        feed = candidate_ids[:, past:]
        mask = mask_buf[:, :cur + k] if mask_buf is not None else None
        out = model(feed, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=k + 1)
        if out.past_key_values is not None:
            cache = out.past_key_values
        logits = out.logits[:, -(k + 1):, :].float()

        # processors position by position, on the prefix each position would see
        new_scores = [logits_processor(candidate_ids[:, :cur + i], logits[:, i].clone()) for i in range(k + 1)]

        if do_sample:
            n_matches, next_token = _speculative_accept(candidates, candidate_logits, new_scores)
        else:
            chosen = torch.stack([s.argmax(dim=-1) for s in new_scores], dim=1)  # (1, k + 1)
            agree = (chosen[0, :k] == candidates[0]).long()
            n_matches = int(agree.cumprod(0).sum()) if k else 0
            next_token = int(chosen[0, n_matches])
        new_tokens = candidates[0, :n_matches].tolist() + [next_token]

        # append one at a time, checking the stopping criteria as plain decoding would
        appended = 0
        for tok in new_tokens:
            seqs = torch.cat([seqs, seqs.new_tensor([[tok]])], dim=1)
            if want_scores:
                scores_out.append(new_scores[appended])
            if want_logits:
                logits_out.append(logits[:, appended].clone())
            appended += 1
            if streamer is not None:
                streamer.put(seqs.new_tensor([tok]).cpu())
            done = (tok in eos_set or seqs.shape[1] >= max_length
                    or (bool(others) and bool(StoppingCriteriaList(others)(seqs, new_scores[appended - 1]).all())))
            if done:
                break

        rounds += 1
        drafted_total += k
        accepted_total += min(n_matches, appended)
        if done:
            break
        # the cache must hold everything but the newest token
        past = seqs.shape[1] - 1
        _crop_to(cache, past)
        generator.update_candidate_strategy(seqs, torch.stack(new_scores, dim=1), n_matches)

    logger.debug("assisted decoding: %d rounds, %d drafted, %d accepted", rounds, drafted_total, accepted_total)
    _crop_to(cache, seqs.shape[1] - 1)
    return GenerateDecoderOnlyOutput(
        sequences=seqs,
        scores=tuple(scores_out) if want_scores else None,
        logits=tuple(logits_out) if want_logits else None,
        past_key_values=cache,
    )


def _crop_to(cache: Any, keep: int) -> None:
    """Drop the cached positions after the first ``keep``. By a negative count: genkit's caches read
    ``crop(n)`` as "keep n" but also take "-n: drop n", and a plain transformers ``DynamicCache``
    (a passed prompt cache) takes only the latter."""
    drop = cache.get_seq_length() - keep if cache is not None else 0
    if drop > 0:
        cache.crop(-drop)


def _speculative_accept(candidates: torch.Tensor, candidate_logits: torch.Tensor | None,
                        new_scores: list[torch.Tensor]) -> tuple[int, int]:
    """Speculative sampling acceptance; returns (accepted candidates, the extra token)."""
    k = candidates.shape[1]
    p = [torch.softmax(s[0], dim=-1) for s in new_scores]  # target distributions, k + 1 of them
    for i in range(k):
        x = int(candidates[0, i])
        if candidate_logits is not None:
            q = torch.softmax(candidate_logits[0, i].float().to(p[i].device), dim=-1)
        else:
            q = torch.zeros_like(p[i])
            q[x] = 1.0
        px, qx = float(p[i][x]), float(q[x])
        if qx > 0 and float(torch.rand(())) < min(1.0, px / qx):
            continue
        residual = (p[i] - q).clamp_min(0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1))
    return k, int(torch.multinomial(p[k], 1))
