"""Built-in candidate generators for assisted (speculative) decoding.

A candidate generator proposes tokens that the target model then verifies in one forward pass:

- ``get_candidates(input_ids) -> (candidate_ids, candidate_logits | None)``: ``candidate_ids`` is
  ``input_ids`` followed by the proposed tokens, shape ``(batch, cur_len + k)``; ``candidate_logits``
  is ``(batch, k, vocab)`` — the draft's scores for each proposed token, needed for the speculative
  sampling acceptance rule — or ``None`` when the source has no distribution (n-gram lookup).
- ``update_candidate_strategy(input_ids, scores, num_matches)``: told after each verification how
  many proposed tokens the target accepted, so the generator can adapt.

Factories have the signature ``factory(model, config, **kwargs)``. The assisted strategy passes the
context keywords ``assistant_model`` and ``logits_processor`` plus the user's
``candidate_generator_kwargs``; a factory takes what it needs and must accept the rest as
``**kwargs``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.errors import ConfigError, NotSupportedError
from genkit.strategy import check_choosable, eos_token_ids, model_vocab_size

logger = logging.getLogger("genkit.candidates")

__all__ = ["DraftModelCandidateGenerator", "PromptLookupCandidateGenerator", "adapted_threshold", "draft_model",
           "draft_policy", "prompt_lookup"]

# the draft policy: transformers reads it from the assistant's own generation config
DRAFT_POLICY = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


class PromptLookupCandidateGenerator:
    """Drafts by n-gram lookup in the sequence itself (prompt lookup decoding), draft for draft as
    transformers 5's ``PromptLookupCandidateGenerator``, so a sampled run draws its tokens for a seed.

    The last ``n`` tokens (``n`` from ``max_matching_ngram_size``, at most the length - 1, down to
    1) are searched for in the sequence from left to right: the first (earliest) match followed by
    a token proposes the tokens after it, at most ``num_output_tokens`` and up to the end of the
    sequence. With ``logits_processor`` (and ``vocab_size``) the proposal is cut before its first
    token the processors forbid (score ``-inf`` or the dtype's lowest after processing logits of
    ones on the sequence so far), and a match whose first token is forbidden is passed over. The
    proposal then ends before its first EOS token (``eos_token_ids``); one that starts with EOS
    means no draft this round. No draft either when ``max_length`` leaves room for one token only.
    Otherwise ``max_length`` does not shorten the draft (transformers verifies it whole and keeps
    the tokens that fit; the strategy does the same, see ``assisted``).
    """

    def __init__(self, num_output_tokens: int = 10, max_matching_ngram_size: int = 2,
                 eos_token_ids: list[int] | None = None, *, logits_processor: Any = None,
                 vocab_size: int | None = None, max_length: int | None = None) -> None:
        if not isinstance(num_output_tokens, int) or num_output_tokens < 1:
            raise ConfigError(f"`prompt_lookup_num_tokens` must be an int >= 1; got {num_output_tokens!r}")
        if not isinstance(max_matching_ngram_size, int) or max_matching_ngram_size < 1:
            raise ConfigError(f"`max_matching_ngram_size` must be an int >= 1; got {max_matching_ngram_size!r}")
        self.num_output_tokens = num_output_tokens
        self.max_matching_ngram_size = max_matching_ngram_size
        self.eos_token_ids = set(eos_token_ids or ())
        self.logits_processor = logits_processor
        self.vocab_size = vocab_size
        self.max_length = max_length

    def get_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        if input_ids.shape[0] != 1:
            raise NotSupportedError("prompt lookup drafting supports batch size 1")
        seq = input_ids[0]
        length = seq.shape[0]
        if self.max_length is not None and self.max_length == length + 1:
            return input_ids, None
        for n in range(min(self.max_matching_ngram_size, length - 1), 0, -1):
            hits = (seq.unfold(0, n, 1) == seq[length - n:]).all(dim=1).nonzero().flatten()
            for start in hits.tolist():  # the earliest match first
                proposal = self._allowed(input_ids, seq[start + n:start + n + self.num_output_tokens])
                if proposal.numel() == 0:
                    continue  # nothing follows (the tail itself), or its first token is forbidden
                ids = proposal.tolist()
                cut = next((i for i, t in enumerate(ids) if t in self.eos_token_ids), len(ids))
                if cut == 0:
                    return input_ids, None
                return torch.cat([input_ids, proposal[None, :cut]], dim=1), None
        return input_ids, None

    def _allowed(self, input_ids: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
        """``proposal`` up to its first token the logits processors forbid after the tokens before it
        (an id outside the vocabulary is not judged here: the model refuses it with a clear error)."""
        if self.logits_processor is None or self.vocab_size is None or proposal.numel() == 0:
            return proposal
        ones = torch.ones((input_ids.shape[0], self.vocab_size), device=input_ids.device, dtype=torch.float32)
        seen = input_ids
        for i, token in enumerate(proposal.tolist()):
            scores = self.logits_processor(seen, ones)
            score = float(scores[0, token]) if 0 <= token < scores.shape[-1] else 0.0
            if score == float("-inf") or score == torch.finfo(scores.dtype).min:
                return proposal[:i]
            seen = torch.cat([input_ids, proposal[None, :i + 1]], dim=1)
        return proposal

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
        return None


class DraftModelCandidateGenerator:
    """Drafts with a smaller assistant model that keeps its own cache.

    ``num_assistant_tokens`` tokens are drafted per round, fewer where the target's ``max_length``
    leaves less room (as transformers does: the assistant never drafts a token that could not be
    kept), and none after an EOS token of the target's (``eos_token_ids``: the draft ends there, as
    transformers' assistant stops at EOS). With the ``"heuristic"`` schedules the number grows by 2
    after a round in which every drafted token was accepted (a draft cut short by the confidence
    threshold or the length included) and shrinks by 1 (not below 1) otherwise; with
    ``"heuristic"`` it is written to ``keep_count_in`` (the assistant's generation config), so the
    next call starts from it (transformers' difference from ``"heuristic_transient"``). Drafting
    stops early when the assistant's probability for its own choice falls below ``assistant_confidence_threshold`` (0 disables). With ``adaptive_threshold``
    (the default, as transformers does when scikit-learn is installed) that threshold is re-chosen
    after every round from the drafts seen so far: the one on their ROC curve (draft probability
    vs. accepted) that minimises ``false positive rate + 3 * false negative rate``
    (:func:`adapted_threshold`; no scikit-learn needed). The draft sees the same
    logits processors as the target. When ``do_sample`` is set it samples from its processed
    distribution; its scores are returned either way, so the strategy can apply the speculative
    sampling acceptance rule.
    """

    def __init__(self, assistant_model: Any, *, num_assistant_tokens: int = 20,
                 schedule: str = "constant", confidence_threshold: float = 0.0, do_sample: bool = False,
                 logits_processor: Any = None, adaptive_threshold: bool = True,
                 max_length: int | None = None, eos_token_ids: list[int] | None = None,
                 keep_count_in: Any = None) -> None:
        if assistant_model is None:
            raise ConfigError("the `draft_model` candidate generator needs `assistant_model=` in generate()")
        if schedule not in ("constant", "heuristic", "heuristic_transient"):
            raise ConfigError(
                 '`num_assistant_tokens_schedule` must be "constant", "heuristic" or "heuristic_transient"; '
                 f"got {schedule!r}"
             )
        self.model = assistant_model
        self.num_assistant_tokens = int(num_assistant_tokens)
        self.max_length = max_length
        self.eos_token_ids = set(eos_token_ids or ())
        self.keep_count_in = keep_count_in if schedule == "heuristic" else None
        self.schedule = schedule
        self.confidence_threshold = float(confidence_threshold)
        self.adaptive_threshold = adaptive_threshold and self.confidence_threshold > 0
        self._probs: list[float] = []  # the assistant's probability of each drafted token
        self._matches: list[int] = []  # 1 where the target accepted it, 0 for the first rejected one
        self.do_sample = do_sample
        self.logits_processor = logits_processor
        self.cache: Any = assistant_model.new_cache() if hasattr(assistant_model, "new_cache") else None
        record = getattr(self.cache, "record_past", None)
        if record is not None:  # sliding-window layers keep what a draft adds until the next crop
            record(True)
        self._seen = 0  # tokens of the sequence the assistant cache holds
        self._last: torch.Tensor | None = None  # the sequence of the last draft
        self._pending_logits: torch.Tensor | None = None  # assistant logits after the last seen token

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(ids, past_key_values=self.cache, use_cache=self.cache is not None, logits_to_keep=1)
        if self.cache is None:
            return out.logits[:, -1, :].float()
        self.cache = out.past_key_values if out.past_key_values is not None else self.cache
        return out.logits[:, -1, :].float()

    def _choose(self, scores: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The draft's token ``(rows, 1)`` from its processed ``scores`` and their softmax ``probs``:
        the argmax or a draw; a row the processors left no token raises (the sampler's check)."""
        if not self.do_sample:
            token = scores.argmax(dim=-1, keepdim=True)
            check_choosable(scores, token[:, 0])
            return token
        try:
            return torch.multinomial(probs, num_samples=1)
        except RuntimeError:  # NaN probabilities: a row with no token allowed?
            check_choosable(scores, scores.argmax(dim=-1))
            raise

    def get_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if input_ids.shape[0] != 1:
            raise NotSupportedError("draft-model drafting supports batch size 1")
        k = self.num_assistant_tokens
        if self.max_length is not None:
            k = min(k, self.max_length - input_ids.shape[1] - 1)
        if k < 1:
            return input_ids, None
        if self.cache is not None:
            # roll the assistant back to what is still valid, then feed what it has not seen
            keep = min(self._seen, input_ids.shape[1] - 1)
            if self._last is not None and keep > 0:
                n = min(keep, self._last.shape[1])
                differ = (self._last[0, :n] != input_ids[0, :n]).nonzero()
                if differ.numel():
                    keep = int(differ[0, 0])
            self.cache.crop(keep)  # (recording sliding-window layers are cut back to the window even when nothing goes)
            logits = self._forward(input_ids[:, keep:])
        else:
            logits = self._forward(input_ids)
        seq = input_ids
        drafted: list[torch.Tensor] = []
        scores_out: list[torch.Tensor] = []
        for i in range(k):
            scores = self.logits_processor(seq, logits) if self.logits_processor is not None else logits
            probs = torch.softmax(scores, dim=-1)
            token = self._choose(scores, probs)
            drafted.append(token)
            scores_out.append(scores)
            if self.adaptive_threshold:
                self._probs.append(float(probs.gather(1, token).min()))
            seq = torch.cat([seq, token], dim=1)
            if int(token) in self.eos_token_ids or (self.confidence_threshold > 0 and i < k - 1
                                                     and float(probs.gather(1, token).min()) < self.confidence_threshold):
                break
            if i < k - 1:
                logits = self._forward(token if self.cache is not None else seq)
        self._seen = seq.shape[1] - 1  # the cache holds everything but the last draft token
        self._last = seq
        return seq, torch.stack(scores_out, dim=1)

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
        if self.schedule in ("heuristic", "heuristic_transient"):
            if num_matches >= scores.shape[1] - 1:  # every drafted token accepted (transformers' rule)
                self.num_assistant_tokens += 2
            else:
                self.num_assistant_tokens = max(1, self.num_assistant_tokens - 1)
            if self.keep_count_in is not None:  # "heuristic": the count carries over to the next call
                self.keep_count_in.num_assistant_tokens = self.num_assistant_tokens
        if self.adaptive_threshold:
            # the accepted drafts are 1s, the first rejected one a 0; later drafts were never judged
            self._matches.extend([1] * num_matches)
            if len(self._probs) > len(self._matches):
                self._matches.append(0)
            del self._probs[len(self._matches):]
            if len(self._probs) > 5 and 0 in self._matches and 1 in self._matches:
                self.confidence_threshold = adapted_threshold(self._probs, self._matches)


def adapted_threshold(probs: list[float], matches: list[int]) -> float:
    """The draft-probability threshold that minimises ``fpr + 3 * fnr`` on the ROC curve of
    ``probs`` (scores) against ``matches`` (labels): transformers' rule, computed as
    ``sklearn.metrics.roc_curve`` does (thresholds at the distinct scores, highest first, after
    ``inf``; the first of equal costs wins)."""
    positives = sum(matches)
    negatives = len(matches) - positives
    pairs = sorted(zip(probs, matches), key=lambda pm: -pm[0])
    best_cost, best = 3.0, float("inf")  # the threshold inf: nothing predicted positive (fpr 0, fnr 1)
    tp = fp = 0
    for k, (p, m) in enumerate(pairs):
        tp += m
        fp += 1 - m
        if k + 1 < len(pairs) and pairs[k + 1][0] == p:
            continue  # one point per distinct score
        cost = fp / negatives + 3 * (1 - tp / positives)
        if cost < best_cost:
            best_cost, best = cost, p
    return best


def prompt_lookup(model: Any, config: Any, *, logits_processor: Any = None,
                  **kwargs: Any) -> PromptLookupCandidateGenerator:
    """Factory of the ``"prompt_lookup"`` candidate generator.

    Reads ``prompt_lookup_num_tokens`` (default 10), ``max_matching_ngram_size`` (default 2),
    ``max_length`` and the EOS ids from the config; ``num_output_tokens`` /
    ``max_matching_ngram_size`` keywords override the first two. The call's logits processors
    (and the model's vocabulary size) pick out forbidden draft tokens, as in transformers.
    """
    return PromptLookupCandidateGenerator(
        num_output_tokens=kwargs.get("num_output_tokens", config.prompt_lookup_num_tokens or 10),
        max_matching_ngram_size=kwargs.get("max_matching_ngram_size", config.max_matching_ngram_size or 2),
        eos_token_ids=eos_token_ids(config.eos_token_id),
        logits_processor=logits_processor,
        vocab_size=model_vocab_size(model),
        max_length=config.max_length,
    )


def draft_policy(config: Any, assistant_model: Any) -> dict[str, Any]:
    """``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold``
    of a call. transformers reads them from the assistant's own ``generation_config`` (where the
    ``"heuristic"`` schedule also keeps its count between calls), so a value set there is used;
    one the caller set for this call (``generate(num_assistant_tokens=...)``, which transformers
    ignores) wins over it; else the call's config (the target's file, the defaults)."""
    from genkit.config.fields import field_table

    own = getattr(assistant_model, "generation_config", None)
    table, user_set = field_table(), getattr(config, "user_set", frozenset())
    policy = {}
    for name in DRAFT_POLICY:
        value, theirs = getattr(config, name), getattr(own, name, None)
        if name not in user_set and theirs is not None:
            try:
                table[name].validate(theirs)
            except ConfigError as exc:
                raise ConfigError(f"assistant_model.generation_config: {exc}") from None
            value = theirs
        policy[name] = value
    return policy


def draft_model(model: Any, config: Any, *, assistant_model: Any = None, logits_processor: Any = None,
                **kwargs: Any) -> DraftModelCandidateGenerator:
    """Factory of the ``"draft_model"`` candidate generator (the assistant model drafts).

    Reads the draft policy (:func:`draft_policy`), ``do_sample``, ``max_length`` and the EOS ids
    from the config.
    """
    tv, av = model_vocab_size(model), model_vocab_size(assistant_model)
    if tv is not None and av is not None and tv != av:
        raise ConfigError(
            f"`assistant_model` has another vocabulary (vocab_size {av} vs the target's {tv}): pass "
            "`tokenizer=` (the target's) and `assistant_tokenizer=` (the assistant's) for universal assisted "
            "decoding"
        )
    policy = draft_policy(config, assistant_model)
    return DraftModelCandidateGenerator(
        assistant_model,
        num_assistant_tokens=kwargs.get("num_assistant_tokens", policy["num_assistant_tokens"]),
        schedule=policy["num_assistant_tokens_schedule"],
        confidence_threshold=kwargs.get("confidence_threshold", policy["assistant_confidence_threshold"]),
        do_sample=bool(config.do_sample),
        logits_processor=logits_processor,
        max_length=config.max_length,
        eos_token_ids=eos_token_ids(config.eos_token_id),
        keep_count_in=getattr(assistant_model, "generation_config", None),
    )
