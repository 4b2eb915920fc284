"""Batch engines: what turns a list of rows into output rows.

An engine is any object with ``run(rows) -> list[dict | BadRow]`` (one entry per row, in order):
the job (:mod:`genkit.batch.job`) reads, skips, chunks and writes; the engine only generates.
:class:`LocalEngine` runs ``genkit.generate`` in one process on left-padded batches of rows that
share their settings.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

import torch

from genkit.strategy import eos_token_ids, openai_finish_reason

from ..errors import ConfigError, GenerationError, NotSupportedError
from ..generation.padding import padding_group, padding_readers
from .rows import BadRow, BatchRow

# the most alternatives per prompt token a job may ask for (vLLM's default max_logprobs)
MAX_PROMPT_LOGPROBS = 20

logger = logging.getLogger("genkit.batch")


class BatchEngine(Protocol):
    def run(self, rows: list[BatchRow]) -> list[dict[str, Any] | BadRow]: ...


class LocalEngine:
    """``genkit.generate`` on left-padded batches of up to ``batch_size`` rows with the same settings.
    An encoder-decoder model's rows are its encoder's inputs, padded on the right (its positions
    count from the first token), and its output the decoder's tokens after its start token.

    ``generation_kwargs`` apply to every row (a row's own fields override them); ``custom_generate``
    and ``trust_remote_code`` reach ``generate`` as they are, so a recipe obeys the trust rules."""

    def __init__(self, model: Any, tokenizer: Any, generation_kwargs: dict[str, Any] | None = None,
                 batch_size: int = 16, custom_generate: Any = None, trust_remote_code: bool | None = None,
                 prompt_logprobs: int | None = None) -> None:
        from genkit.generation.api import as_protocol_model
        from genkit.generation.encoder_decoder import is_encoder_decoder, text_prompt_refusal

        if batch_size < 1:
            raise ConfigError(f"`batch_size` must be >= 1; got {batch_size}")
        model = as_protocol_model(model)  # a transformers model in genkit's adapter, as generate runs it
        why = text_prompt_refusal(model, "genkit batch")
        if why is not None:
            raise NotSupportedError(why)
        self.seq2seq = is_encoder_decoder(model)
        self.prompt_top = check_prompt_logprobs(prompt_logprobs, self.seq2seq)
        self.model = model
        self.tokenizer = tokenizer
        self.kwargs = dict(generation_kwargs or {})
        self.batch_size = batch_size
        self.extra: dict[str, Any] = {}
        if custom_generate is not None:
            self.extra = {"custom_generate": custom_generate, "trust_remote_code": trust_remote_code}
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = model.config.get("pad_token_id") if hasattr(model.config, "get") else None
        eos = eos_token_ids(getattr(model.generation_config, "eos_token_id", None))
        self.pad = int(pad if pad is not None else (min(eos) if eos else 0))
        self._padding_rule: dict[str, dict[str, int | None]] = {}  # settings -> what their padding changes

    def encode(self, row: BatchRow) -> list[int]:
        if row.messages is not None:
            ids = self.tokenizer.apply_chat_template(row.messages, add_generation_prompt=True)
            ids = ids if isinstance(ids, (list, torch.Tensor)) else ids["input_ids"]
        else:
            ids = self.tokenizer(row.prompt)["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        ids = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        if not ids:
            raise ConfigError("the prompt encodes to no tokens")
        return ids

    def run(self, rows: list[BatchRow]) -> list[dict[str, Any] | BadRow]:
        results: dict[int, dict[str, Any] | BadRow] = {}
        groups: dict[str, list[tuple[int, BatchRow, list[int]]]] = {}
        for i, row in enumerate(rows):
            try:
                ids = self.encode(row)
            except Exception as exc:  # noqa: BLE001 - the row's error
                results[i] = BadRow(row.line, row.id, f"cannot encode the prompt: {exc}")
                continue
            settings = {**self.kwargs, **row.settings}
            key = json.dumps(settings, sort_keys=True, default=str)
            group = padding_group(self._padding_readers(key, settings), len(ids))
            if group is not None:  # a batch's padding would count or be read as this row's tokens
                key += f"\n{group}"
            groups.setdefault(key, []).append((i, row, ids))
        for items in groups.values():
            size = self.batch_size if "stop_strings" not in {**self.kwargs, **items[0][1].settings} else 1
            for start in range(0, len(items), size):
                # a row a stop string ends is padded after it in a shared batch, indistinguishable
                # from tokens: such rows run one per call until the finish decision reports it
                chunk = items[start:start + size]
                outs: list[Any]
                try:
                    outs = self._generate([ids for _, _, ids in chunk], {**self.kwargs, **chunk[0][1].settings})
                except Exception as exc:  # noqa: BLE001 - find the rows that fail, one by one
                    logger.warning("a batch of %d rows failed (%s); running them one by one", len(chunk), exc)
                    outs = []
                    for _, row, ids in chunk:
                        try:
                            outs.append(self._generate([ids], {**self.kwargs, **row.settings})[0])
                        except Exception as row_exc:  # noqa: BLE001
                            outs.append(BadRow(row.line, row.id, f"generation failed: {row_exc}"))
                for (i, row, ids), out in zip(chunk, outs):
                    results[i] = out if isinstance(out, BadRow) else self.result_row(row, ids, out, self._score(ids))
        return [results[i] for i in range(len(rows))]

    def _score(self, ids: list[int]) -> list[Any] | None:
        """The prompt's scores when the job asks for them (``genkit.generation.scoring``), else None."""
        if self.prompt_top is None:
            return None
        from genkit.generation.scoring import score_prompt

        return score_prompt(self.model, ids, top_n=self.prompt_top).tokens

    def _padding_readers(self, key: str, settings: dict[str, Any]) -> dict[str, int | None]:
        """The settings of rows with these settings that their padding would change
        (``genkit.generation.padding``: a ``max_length`` or ``min_length`` that counts the prompt, an
        n-gram ban, ...): such rows share a batch only with prompts out of the padding's reach, so
        each gets the tokens ``generate`` gives it alone."""
        if key not in self._padding_rule:
            from genkit.config import field_table
            from genkit.generation.api import merge_config

            table = field_table()
            try:
                config, _ = merge_config(self.model, None, {k: v for k, v in settings.items() if k in table})
            except ValueError:  # generate reports it, row by row
                self._padding_rule[key] = {}
            else:
                self._padding_rule[key] = padding_readers(config, seq2seq=self.seq2seq, arguments=settings)
        return self._padding_rule[key]

    def _generate(self, prompts: list[list[int]], kwargs: dict[str, Any]) -> list[tuple[list[int], str]]:
        """Each prompt's new tokens (through the first EOS) and why it finished (``generate``'s
        finish decision, ``genkit.strategy.FINISH_REASONS``; a strategy that does not report it:
        ``"eos"`` where an EOS ended the row, else ``"length"``)."""
        import genkit
        from genkit.generation.encoder_decoder import new_tokens_start

        if int(kwargs.get("num_return_sequences") or 1) != 1:
            raise NotSupportedError("`num_return_sequences` must be 1 in a batch job (one output row per input row)")
        width = max(map(len, prompts))
        if self.seq2seq:  # the encoder's input, padded on the right; the output is the decoder's, after its start
            rows = [(p + [self.pad] * (width - len(p)), [1] * len(p) + [0] * (width - len(p))) for p in prompts]
        else:
            rows = [([self.pad] * (width - len(p)) + p, [0] * (width - len(p)) + [1] * len(p)) for p in prompts]
        ids = torch.tensor([r for r, _ in rows], device=self.model.device)
        mask = torch.tensor([m for _, m in rows], device=self.model.device)
        # the output object whatever the row says: its finish reasons are the rows' (a row's
        # return_dict_in_generate=False turned a stop string's "stop" into "length")
        out = genkit.generate(self.model, input_ids=ids, attention_mask=mask, tokenizer=self.tokenizer,
                              **{"pad_token_id": self.pad, **kwargs, "return_dict_in_generate": True}, **self.extra)
        sequences = out.sequences if hasattr(out, "sequences") else out
        reasons = getattr(out, "finish_reasons", None) or [None] * len(prompts)
        eos = self.eos_ids(kwargs)
        results = []
        for row, reason in zip(sequences[:, new_tokens_start(self.model, width):].tolist(), reasons):
            cut = next((k for k, t in enumerate(row) if t in eos), None)
            tokens = row[:cut + 1] if cut is not None else row
            results.append((tokens, reason or ("eos" if cut is not None else "length")))
        return results

    def eos_ids(self, kwargs: dict[str, Any]) -> set[int]:
        """The EOS ids of a row with these settings (its own ``eos_token_id``, else the model's)."""
        value = kwargs["eos_token_id"] if "eos_token_id" in kwargs else self.model.generation_config.eos_token_id
        return set(eos_token_ids(value))

    def result_row(self, row: BatchRow, prompt: list[int], out: tuple[list[int], str | None],
                   scores: list[Any] | None = None) -> dict[str, Any]:
        """The output row: new tokens (through the first EOS) and why they ended, as OpenAI's
        ``finish_reason`` (``genkit.strategy.openai_finish_reason``); with the job's prompt
        log-probabilities, the prompt's ``scores`` (:func:`prompt_logprobs_column`)."""
        tokens, reason = out
        result = {
            "id": row.id,
            "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "token_ids": tokens,
            "finish_reason": openai_finish_reason(reason),
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
        }
        if self.prompt_top is not None:
            if scores is None or len(scores) != len(prompt) - 1:
                raise GenerationError(f"row {row.id!r}: its prompt's scores are missing")
            result["prompt_logprobs"] = prompt_logprobs_column(scores)
        return result


def check_prompt_logprobs(top: int | None, seq2seq: bool) -> int | None:
    """A job's ``prompt_logprobs`` (alternatives per prompt token; None: the prompts are not
    scored): an int from 0 to :data:`MAX_PROMPT_LOGPROBS`, for a causal LM."""
    from genkit.generation.scoring import check_top_n

    if top is None:
        return None
    check_top_n(top, "prompt_logprobs", MAX_PROMPT_LOGPROBS)
    if seq2seq:
        raise NotSupportedError("`prompt_logprobs` needs a causal LM: an encoder-decoder model's prompt is its "
                                "encoder's input, which it gives no probabilities to")
    return top


def prompt_logprobs_column(scores: list[Any]) -> list[dict[str, Any] | None]:
    """An output row's ``prompt_logprobs``: ``None`` for the first prompt token (nothing before it),
    then per token ``{"token", "logprob", "rank", "top": [{"token", "logprob"}, ...]}``."""
    return [None] + [{"token": s.token, "logprob": s.logprob, "rank": s.rank,
                      "top": [{"token": t, "logprob": lp} for t, lp in s.top]} for s in scores]
