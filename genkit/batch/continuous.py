"""The local engine on continuous batching (``genkit batch --batching continuous|auto``).

:class:`ContinuousEngine` hands rows to one :class:`~genkit.continuous.ContinuousBatchingManager`
as requests, each with its own settings, and keeps up to ``4 * batch_size`` of them in flight, so
the batch never drains between chunks of the job; results come back in input order. A row whose
settings continuous batching does not run (what its gate, :mod:`genkit.continuous.gate`, refuses:
beam search, contrastive search, DoLa, guidance, watermarking, several sequences...) goes to the static engine (:class:`~genkit.batch.engine.LocalEngine`,
left-padded ``generate``) beside it. Greedy output is token for token the static engine's.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from genkit.recipes.reference import classify

from ..errors import ConfigError, GenerationError, NotSupportedError
from .engine import LocalEngine
from .rows import BadRow, BatchRow

logger = logging.getLogger("genkit.batch")

BATCHING = ("auto", "continuous", "static")

def continuous_refusal(model: Any, settings: dict[str, Any], custom_generate: Any = None) -> str | None:
    """Why continuous batching cannot run a row with these (merged) generation settings, naming
    the field; None when it can (the one gate, :func:`genkit.continuous.gate.refusal_for_kwargs`)."""
    from genkit.continuous.gate import refusal_for_kwargs

    return refusal_for_kwargs(model, settings, custom_generate=custom_generate)


class _Slot:
    __slots__ = ("row", "ids", "result")

    def __init__(self, row: BatchRow) -> None:
        self.row = row
        self.ids: list[int] = []
        self.result: dict[str, Any] | BadRow | None = None


class ContinuousEngine:
    """Rows as continuous batching requests (see the module docstring). ``batch_size`` is the
    most requests in one step (``max_requests_per_batch``) and the static engine's batch size."""

    def __init__(self, model: Any, tokenizer: Any, generation_kwargs: dict[str, Any] | None = None,
                 batch_size: int = 16, continuous_batching_config: Any = None,
                 prompt_logprobs: int | None = None) -> None:
        from genkit.continuous import ContinuousBatchingConfig, ContinuousBatchingManager

        self.static = LocalEngine(model, tokenizer, generation_kwargs, batch_size=batch_size,
                                  prompt_logprobs=prompt_logprobs)
        self.kwargs = self.static.kwargs
        self.batch_size = batch_size
        self.window = 4 * batch_size
        cb = continuous_batching_config or ContinuousBatchingConfig(max_requests_per_batch=batch_size)
        self.manager = ContinuousBatchingManager(model, continuous_batching_config=cb)
        self._ids = itertools.count()

    def run(self, rows: list[BatchRow]) -> list[dict[str, Any] | BadRow]:
        return list(self.stream(rows))

    def stream(self, rows: Iterable[BatchRow]) -> Iterator[dict[str, Any] | BadRow]:
        """Each row's result, in input order, as they finish."""
        slots: deque[_Slot] = deque()
        running: dict[str, _Slot] = {}
        static: list[_Slot] = []
        source = iter(rows)
        exhausted = False
        self.manager.start()
        try:
            while True:
                while not exhausted and len(slots) < self.window:
                    row = next(source, None)
                    if row is None:
                        exhausted = True
                        break
                    slots.append(self._submit(row, running, static))
                if static and (len(static) >= self.batch_size or exhausted or slots[0] in static):
                    self._run_static(static)
                while slots and slots[0].result is not None:
                    result = slots.popleft().result
                    assert result is not None
                    yield result
                if not slots and exhausted:
                    return
                if slots and slots[0].result is None and not (static and slots[0] in static):
                    self._collect(running)
        finally:
            self.manager.stop(block=True, timeout=30)

    def _submit(self, row: BatchRow, running: dict[str, _Slot], static: list[_Slot]) -> _Slot:
        slot = _Slot(row)
        try:
            slot.ids = self.static.encode(row)
        except Exception as exc:  # noqa: BLE001 - the row's error
            slot.result = BadRow(row.line, row.id, f"cannot encode the prompt: {exc}")
            return slot
        settings = {**self.kwargs, **row.settings}
        why = continuous_refusal(self.static.model, settings)
        if why is not None:
            logger.debug("row %s on static batches: %s", row.id, why)
            static.append(slot)
            return slot
        rid = f"batch{next(self._ids)}"
        running[rid] = slot
        max_new = settings.pop("max_new_tokens", None)
        try:
            self.manager.add_request(slot.ids, request_id=rid, max_new_tokens=max_new, tokenizer=self.static.tokenizer,
                                     prompt_logprobs=self.static.prompt_top, **settings)
        except Exception as exc:  # noqa: BLE001 - the row's error; the job goes on
            running.pop(rid, None)
            slot.result = BadRow(row.line, row.id, f"generation failed: {exc}")
        return slot

    def _run_static(self, static: list[_Slot]) -> None:
        for slot, result in zip(static, self.static.run([s.row for s in static])):
            slot.result = result
        static.clear()

    def _collect(self, running: dict[str, _Slot]) -> None:
        """Wait for the manager's next finished request and file its result."""
        out = self.manager.get_result(timeout=1)
        if out is None:
            if not self.manager.is_running():
                raise GenerationError(f"continuous batching stopped: {self.manager.error}")
            return
        slot = running.pop(out.request_id, None)
        if slot is None or not out.is_finished():
            return
        if out.error is not None:
            slot.result = BadRow(slot.row.line, slot.row.id, f"generation failed: {out.error}")
            return
        slot.result = self.static.result_row(slot.row, slot.ids, (list(out.generated_tokens), out.finish_reason),
                                             out.prompt_logprobs)


def check_batching(batching: str, generation_kwargs: dict[str, Any], custom_generate: Any = None,
                   model: Any = None) -> str | None:
    """Why the job's settings need static batches (None: continuous batching runs them); with
    ``batching="continuous"`` that reason is an error. Checks ``batching`` itself, and refuses a
    job-wide ``num_return_sequences`` other than 1. ``model``
    (None before it loads) gives the generation config the settings go over."""
    if batching not in BATCHING:
        raise ConfigError(f"`batching` must be one of {', '.join(repr(b) for b in BATCHING)}; got {batching!r}")
    classify(custom_generate)  # a reference that names nothing fails before any row runs
    n = generation_kwargs.get("num_return_sequences")
    if n is not None and n != 1:  # every row would fail
        raise ConfigError(f"`num_return_sequences` must be 1 in a batch job (one output row per input row); got {n!r}")
    why = continuous_refusal(model, generation_kwargs, custom_generate)
    if batching == "continuous" and why is not None:
        raise ConfigError(f"`batching='continuous'` cannot run this job: {why}; use 'auto' or 'static'")
    return why


def make_local_engine(model: Any, tokenizer: Any, generation_kwargs: dict[str, Any] | None = None,
                      batch_size: int = 16, custom_generate: Any = None, trust_remote_code: bool | None = None,
                      batching: str = "auto", prompt_logprobs: int | None = None) -> LocalEngine | ContinuousEngine:
    """The local engine for ``batching``: ``"static"`` (left-padded ``generate``), ``"continuous"``
    (an error when the model or the job's settings cannot run on it), or ``"auto"`` (continuous
    batching where the model and the settings allow it, else static: an encoder-decoder model
    runs there, :func:`genkit.continuous.gate.model_refusal`). ``prompt_logprobs``: every row's
    prompt scored too, with that many alternatives per token (its output's ``prompt_logprobs``)."""
    from genkit.models.paged import require_paged

    kwargs = dict(generation_kwargs or {})
    why = check_batching(batching, kwargs, custom_generate, model)
    if why is None:
        try:
            require_paged(model)
        except NotSupportedError as exc:
            why = str(exc)
    if batching == "continuous" and why is not None:
        raise ConfigError(f"`batching='continuous'` cannot run this job: {why}; use 'auto' or 'static'")
    if batching == "static" or why is not None:
        if batching == "auto":
            logger.info("batch: static batches (%s)", why)
        return LocalEngine(model, tokenizer, kwargs, batch_size=batch_size, custom_generate=custom_generate,
                           trust_remote_code=trust_remote_code, prompt_logprobs=prompt_logprobs)
    return ContinuousEngine(model, tokenizer, kwargs, batch_size=batch_size, prompt_logprobs=prompt_logprobs)
