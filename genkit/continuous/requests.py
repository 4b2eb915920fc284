"""Requests of continuous batching: their state in the engine, and the outputs users get (the
shape of transformers 5's ``GenerationOutput``)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

import torch

from genkit.errors import ConfigError

__all__ = ["GenerationOutput", "RequestState", "RequestStatus", "own_objects"]

REQUEST_OBJECTS = ("logits_processor", "stopping_criteria")  # a request's own objects, run as generate runs them


def _kept(value: Any) -> bool:
    """Whether a copy of a processor keeps ``value`` itself: a model or other module, a tokenizer
    (what a processor reads, never changes; costly to copy)."""
    return isinstance(value, torch.nn.Module) or (callable(getattr(value, "encode", None))
                                                   and callable(getattr(value, "decode", None)))


def own_objects(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a copy (``copy.deepcopy``) of its ``logits_processor`` and ``stopping_criteria``
    lists, for one of several requests given the same ones: each request runs its own, as ``generate``
    runs them for one call, so that one that keeps state (a grammar processor's matchers, the prompt
    length it read first, a criterion's count) sees one request's tokens only. Modules and tokenizers
    they hold are shared. One that cannot be copied is a :class:`ConfigError` naming the argument."""
    out = dict(kwargs)
    for name in REQUEST_OBJECTS:
        objects = kwargs.get(name)
        if not objects:
            continue
        memo = {id(v): v for obj in objects for v in getattr(obj, "__dict__", {}).values() if _kept(v)}
        try:
            out[name] = copy.deepcopy(objects, memo)
        except Exception as exc:  # noqa: BLE001 - whatever a user's object raises when copied
            raise ConfigError(f"`{name}`: given to several requests, each runs its own copy (as generate runs one "
                              f"per call), and this one cannot be copied ({type(exc).__name__}: {exc}); give each "
                              "request its own objects (add_request)") from exc
    return out


class RequestStatus(IntEnum):
    """A request's life: waiting, computing its prompt, generating, then finished or failed."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


@dataclass
class GenerationOutput:
    """What a request produced (so far, for a streaming request).

    ``error`` is None on success; ``status`` is :class:`RequestStatus`; ``lifespan`` is (time the
    request left the queue, time it finished) in ``time.perf_counter`` seconds; ``timestamps`` holds
    one time per generated token when asked for (``record_timestamps``). ``finish_reason`` says why
    a finished request ended (``genkit.strategy.FINISH_REASONS``: ``"eos"``, ``"length"``,
    ``"stop_string"``, ``"max_time"``, ``"criteria"``; ``"cancelled"`` for a cancelled one; None
    while it runs or when it failed). ``top_logprobs`` holds, per generated token, the most likely
    alternatives as ``(token id, log-probability)`` pairs, best first, when the request asked for
    them (``add_request(top_logprobs=k)``). ``max_new_tokens`` is the limit the request ran with:
    what it asked for (the default length capped by the model's context) (None for a request refused on arrival).
    ``prompt_logprobs``: with ``add_request(prompt_logprobs=k)``, once the prompt is computed, its
    tokens after the first scored (:class:`genkit.generation.scoring.TokenScore`, ``k`` alternatives
    each), as :func:`genkit.generation.scoring.score_prompt` scores them."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    finish_reason: str | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    max_new_tokens: int | None = None
    prompt_logprobs: list[Any] | None = None

    def is_finished(self) -> bool:
        """Whether the request reached a terminal state (finished or failed)."""
        return self.status >= RequestStatus.FINISHED


@dataclass
class RequestState:
    """A request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop: Any  # its genkit.strategy.StopConditions (None for a request that failed on arrival)
    config: Any  # the request's GenerationConfig (sampling fields)
    processors: Any  # its LogitsProcessorList (None: greedy with nothing to apply)
    do_sample: bool = False
    generator: torch.Generator | None = None
    streaming: bool = False
    record_timestamps: bool = False
    return_logprobs: bool = False
    top: int = 0  # alternatives to report per token (top log-probabilities)
    finish_reason: str | None = None
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in the cache
    from_cache: int = 0  # of those, the prompt tokens taken from the prompt cache when it was admitted
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    timestamps: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    created: float = field(default_factory=time.perf_counter)
    started: float = -1.0
    order: int = 0  # arrival number (schedulers keep arrival order)
    # the prompt scored (add_request(prompt_logprobs=k): k alternatives; None: not scored): the logits of
    # every prompt position not taken from the prompt cache are kept, in chunks of at most `score_chunk` tokens
    prompt_top: int | None = None
    score_chunk: int = 0
    prompt_scores: list[Any] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def pending(self) -> int:
        """Tokens to run through the model before the next token can be chosen."""
        return self.length - self.cached

    def output(self) -> GenerationOutput:
        finished = time.perf_counter() if self.status >= RequestStatus.FINISHED else -1.0
        return GenerationOutput(
            request_id=self.request_id, prompt_ids=list(self.prompt_ids), generated_tokens=list(self.generated),
            logprobs=list(self.logprobs), error=self.error, status=self.status, created_time=self.created,
            lifespan=(self.started, finished), timestamps=list(self.timestamps) if self.record_timestamps else None,
            finish_reason=self.finish_reason, top_logprobs=list(self.top_logprobs),
            max_new_tokens=self.max_new_tokens if self.max_new_tokens or self.prompt_top is not None else None,
            prompt_logprobs=self.scored_prompt())

    @property
    def scoring(self) -> bool:
        """Whether the request's prompt is scored and not yet all computed: a step computes the
        logits of every position of its prompt chunk."""
        return self.prompt_top is not None and self.cached < len(self.prompt_ids)

    def take_scores(self, scores: list[Any]) -> None:
        """Start the prompt's scores with ``scores`` (of its first tokens after the first, from the
        prompt cache: :meth:`~genkit.continuous.block_allocator.BlockAllocator.scored_prefix`), their
        alternatives cut to the request's."""
        k = self.prompt_top or 0
        self.prompt_scores = [s if len(s.top) <= k else replace(s, top=s.top[:k]) for s in scores]

    def scored_prompt(self) -> list[Any] | None:
        """The prompt's scores once every token after the first has one (the list itself: it no
        longer changes), else None."""
        done = self.prompt_top is not None and len(self.prompt_scores) == len(self.prompt_ids) - 1
        return self.prompt_scores if done else None
