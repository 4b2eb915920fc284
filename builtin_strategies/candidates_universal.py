"""Universal assisted decoding: an assistant model whose tokenizer differs from the target's.

The target's tokens are turned into text and re-encoded with the assistant's tokenizer; the
assistant drafts in its own vocabulary (with its own cache, through
:class:`~genkit.builtin_strategies.candidates.DraftModelCandidateGenerator`); the drafted text is
re-encoded with the target's tokenizer and aligned to the target's tokens; the assisted strategy
then verifies the candidates as usual. Under greedy decoding the output is the target's own
greedy output, whatever the drafts (they only decide how many tokens each target pass confirms).
With sampling the drafts count as deterministic proposals (no draft distribution in the target's
vocabulary), which keeps the target's distribution.

Only the text near the end is re-encoded each round. The new target tokens are decoded together
with up to ``target_lookbehind`` target tokens before them (so their text reads as in the whole
sequence), and that text is re-encoded after the assistant's last ``assistant_lookbehind`` tokens;
the drafts go the other way (``assistant_lookbehind`` assistant tokens of context, re-encoded
after the last ``target_lookbehind`` target tokens). The tokens that spell the context's text are
dropped from the re-encoding, so the new tokens line up with the ones already held, whatever the
two tokenizers do at word boundaries; when they cannot line up (a token would straddle the
boundary) the target's whole text is re-encoded, or the drafted text alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genkit.errors import ConfigError

from .candidates import DraftModelCandidateGenerator, draft_policy

logger = logging.getLogger("genkit.candidates")

__all__ = ["UniversalCandidateGenerator", "text_after", "tokens_after", "universal_assisted"]


def text_after(tokens: list[int], start: int, tokenizer: Any, context: int) -> str | None:
    """The text of ``tokens[start:]`` as it reads after ``tokens[:start]``: decoded together with
    up to ``context`` tokens before it (so a leading space or a merged character comes out as in
    the whole text), minus the text of those; ``None`` when the two texts do not line up."""
    first = max(0, start - context)
    whole = tokenizer.decode(tokens[first:], skip_special_tokens=True)
    head = tokenizer.decode(tokens[first:start], skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else None


def tokens_after(tail: list[int], text: str, tokenizer: Any) -> list[int] | None:
    """The tokens that follow ``tail`` when its text is followed by ``text``: the text of both is
    re-encoded and the tokens that spell ``tail``'s text are dropped. ``None`` when no prefix of the
    re-encoding spells exactly that text (a token would straddle the boundary)."""
    head = tokenizer.decode(tail, skip_special_tokens=True)
    ids = [int(t) for t in tokenizer.encode(head + text, add_special_tokens=False)]
    if ids[:len(tail)] == tail:
        return ids[len(tail):]
    for j in range(len(ids) + 1):
        spelled = tokenizer.decode(ids[:j], skip_special_tokens=True)
        if spelled == head:
            return ids[j:]
        if len(spelled) > len(head):
            break
    return None


class UniversalCandidateGenerator:
    """Drafts with an assistant model that has its own tokenizer (see the module docstring)."""

    def __init__(self, assistant_model: Any, target_tokenizer: Any, assistant_tokenizer: Any, *,
                 num_assistant_tokens: int = 20, schedule: str = "constant", confidence_threshold: float = 0.0,
                 target_lookbehind: int = 10, assistant_lookbehind: int = 10, keep_count_in: Any = None) -> None:
        for name, tok in (("tokenizer", target_tokenizer), ("assistant_tokenizer", assistant_tokenizer)):
            if not (callable(getattr(tok, "encode", None)) and callable(getattr(tok, "decode", None))):
                raise ConfigError(f"`{name}` must be a tokenizer with encode(text, add_special_tokens=) and "
                                  f"decode(ids, skip_special_tokens=) (genkit.load_tokenizer or transformers); got "
                                  f"{type(tok).__name__}")
        self.drafter = DraftModelCandidateGenerator(assistant_model, num_assistant_tokens=num_assistant_tokens,
                                                    schedule="constant", confidence_threshold=confidence_threshold,
                                                    adaptive_threshold=False)
        self.target_tokenizer = target_tokenizer
        self.assistant_tokenizer = assistant_tokenizer
        self.schedule = schedule
        self.keep_count_in = keep_count_in if schedule == "heuristic" else None  # as the draft model's
        self.target_lookbehind = int(target_lookbehind)
        self.assistant_lookbehind = int(assistant_lookbehind)
        self.device = getattr(assistant_model, "device", torch.device("cpu"))
        self._assistant_prompt: list[int] | None = None  # the assistant's tokens for the target's last sequence
        self._target_len = 0  # length of that target sequence
        self._target_seen: list[int] = []  # that target sequence
        self._drafted = 0  # candidates given to the target in the last round

    @property
    def num_assistant_tokens(self) -> int:
        return self.drafter.num_assistant_tokens

    def _reencode(self, target: list[int]) -> list[int]:
        text = self.target_tokenizer.decode(target, skip_special_tokens=True)
        return [int(t) for t in self.assistant_tokenizer.encode(text, add_special_tokens=True)]

    def _assistant_tokens(self, target: list[int]) -> list[int]:
        """The assistant's tokens for ``target``: the last round's, extended by the re-encoded text
        of the target tokens that came since (the whole text re-encoded when that does not line up)."""
        before = self._assistant_prompt
        if before is None or self._target_len > len(target) or target[:self._target_len] != self._target_seen:
            return self._reencode(target)
        text = text_after(target, self._target_len, self.target_tokenizer, self.target_lookbehind)
        tail = before[-self.assistant_lookbehind:]
        new = tokens_after(tail, text, self.assistant_tokenizer) if text is not None else None
        return before + new if new is not None else self._reencode(target)

    def _target_candidates(self, target: list[int], assistant: list[int], prompt_len: int) -> list[int]:
        """The drafted text (after the assistant's first ``prompt_len`` tokens) as target tokens after ``target``."""
        text = text_after(assistant, prompt_len, self.assistant_tokenizer, self.assistant_lookbehind)
        if not text:
            return []
        new = tokens_after(target[-self.target_lookbehind:], text, self.target_tokenizer)
        if new is None:  # a token would straddle the boundary: the drafted text alone
            new = [int(t) for t in self.target_tokenizer.encode(text, add_special_tokens=False)]
        return new

    # -- the candidate generator protocol ---------------------------------------------------------
    def get_candidates(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        if input_ids.shape[0] != 1:
            raise ConfigError("universal assisted decoding supports batch size 1")
        target = input_ids[0].tolist()
        prompt = self._assistant_tokens(target)
        drafted, _ = self.drafter.get_candidates(torch.tensor([prompt], dtype=torch.long, device=self.device))
        assistant = drafted[0].tolist()
        self._assistant_prompt, self._target_len, self._target_seen = prompt, len(target), target
        new = self._target_candidates(target, assistant, len(prompt)) if len(assistant) > len(prompt) else []
        self._drafted = len(new)
        if not new:
            return input_ids, None
        extra = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, extra], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.Tensor, scores: torch.Tensor, num_matches: int) -> None:
        if self.schedule in ("heuristic", "heuristic_transient"):
            if self._drafted and num_matches >= self._drafted:
                self.drafter.num_assistant_tokens += 2
            else:
                self.drafter.num_assistant_tokens = max(1, self.drafter.num_assistant_tokens - 1)
            if self.keep_count_in is not None:
                self.keep_count_in.num_assistant_tokens = self.drafter.num_assistant_tokens


def universal_assisted(model: Any, config: Any, *, assistant_model: Any = None, tokenizer: Any = None,
                       assistant_tokenizer: Any = None, **kwargs: Any) -> UniversalCandidateGenerator:
    """Factory of the ``"universal_assisted"`` candidate generator: ``assistant_model`` with its own
    ``assistant_tokenizer``; ``tokenizer`` is the target's. Reads the draft policy
    (:func:`~genkit.builtin_strategies.candidates.draft_policy`), ``target_lookbehind`` and
    ``assistant_lookbehind`` from the config."""
    if assistant_model is None:
        raise ConfigError("universal assisted decoding needs `assistant_model=` in generate()")
    if tokenizer is None or assistant_tokenizer is None:
        missing = "tokenizer" if tokenizer is None else "assistant_tokenizer"
        raise ConfigError(f"universal assisted decoding needs both `tokenizer=` (the target's) and "
                          f"`assistant_tokenizer=` (the assistant's); `{missing}` is missing")
    policy = draft_policy(config, assistant_model)
    return UniversalCandidateGenerator(
        assistant_model, tokenizer, assistant_tokenizer,
        num_assistant_tokens=kwargs.get("num_assistant_tokens", policy["num_assistant_tokens"]),
        schedule=policy["num_assistant_tokens_schedule"],
        confidence_threshold=kwargs.get("confidence_threshold", policy["assistant_confidence_threshold"]),
        target_lookbehind=config.target_lookbehind, assistant_lookbehind=config.assistant_lookbehind,
        keep_count_in=getattr(assistant_model, "generation_config", None),
    )
