"""``genkit.ray``: batch generation on Ray Data (the ``ray`` extra: ``pip install 'genkit-lm[ray]'``).

:class:`Generator` is a callable class for ``Dataset.map_batches``: each actor loads the model and
the tokenizer once, then turns batches of rows (``id``, ``prompt`` or ``messages``, optional
generation fields) into output rows (``id``, ``text``, ``token_ids``, ``finish_reason``, ``usage``,
``error``; with ``prompt_logprobs=K``, ``prompt_logprobs`` too: each prompt token scored, as JSON
text like ``usage``)::

    import ray, genkit.ray
    ds = ray.data.read_json("prompts.jsonl")
    out = ds.map_batches(genkit.ray.Generator, fn_constructor_kwargs={"model": "smollm2",
                         "generation_kwargs": {"max_new_tokens": 64}},
                         compute=ray.data.ActorPoolStrategy(size=2), batch_size=16)
    out.write_json("out/")

:class:`RayEngine` is the engine of ``genkit batch --engine ray``: the job's pending rows are one
Ray Data pipeline through an actor pool (each actor loads the model once per job), and the driver
takes the results as they stream back (``iter_rows``), committing every chunk, so the job keeps its
committed chunks and its resume.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from .batch.continuous import make_local_engine
from .batch.rows import BadRow, BatchRow, parse_record
from .errors import ConfigError

logger = logging.getLogger("genkit.ray")

OUTPUT_COLUMNS = ("id", "text", "token_ids", "finish_reason", "usage", "error", "line")
INT_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "max_length", "min_length", "top_k", "num_beams",
                        "num_return_sequences", "no_repeat_ngram_size", "eos_token_id", "pad_token_id"})


def _python(value: Any) -> Any:
    """A plain Python value from what Ray hands a batch (numpy scalars and arrays)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and value != value:  # NaN: a missing value in a pandas batch
        return None
    return value


class Generator:
    """Generation for ``map_batches`` (one model per actor, loaded once; see the module docstring).

    Args: ``model`` (a loaded model, or anything ``genkit.load_model`` takes), ``tokenizer`` (loaded,
    a reference, or None: the model's), ``generation_kwargs`` (for every row; a row's own fields
    override them), ``batch_size`` (rows per ``generate`` call), ``custom_generate`` and
    ``trust_remote_code`` (passed to ``generate``: a recipe obeys the trust rules on every worker),
    ``revision``, ``dtype``, ``device`` (for loading), ``batching`` (``"auto"``, ``"continuous"`` or
    ``"static"``, as ``genkit batch --batching``), ``prompt_logprobs`` (score every row's prompt with
    that many alternatives per token, as ``genkit batch --prompt-logprobs``: the ``prompt_logprobs``
    column, JSON text).
    """

    def __init__(self, model: Any, tokenizer: Any = None, generation_kwargs: dict[str, Any] | None = None,
                 batch_size: int = 16, custom_generate: Any = None, trust_remote_code: bool | None = None,
                 revision: str | None = None, dtype: str | None = None, device: str | None = None,
                 batching: str = "auto", prompt_logprobs: int | None = None) -> None:
        import genkit

        if isinstance(model, str):
            model_ref = model
            model = genkit.load_model(model_ref, revision=revision, dtype=dtype, device=device,
                                      trust_remote_code=trust_remote_code)
            if tokenizer is None:
                tokenizer = model_ref
        if isinstance(tokenizer, str):
            tokenizer = genkit.load_tokenizer(tokenizer, revision=revision)
        if tokenizer is None:
            raise ConfigError("`tokenizer` is needed when `model` is a loaded model")
        self.engine = make_local_engine(model, tokenizer, generation_kwargs, batch_size=batch_size,
                                        custom_generate=custom_generate, trust_remote_code=trust_remote_code,
                                        batching=batching, prompt_logprobs=prompt_logprobs)
        self.columns = OUTPUT_COLUMNS + (("prompt_logprobs",) if prompt_logprobs is not None else ())

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        import torch

        columns = {k: list(batch[k]) for k in batch} if not hasattr(batch, "to_dict") else \
            {k: list(v) for k, v in batch.to_dict("list").items()}
        n = len(next(iter(columns.values()))) if columns else 0
        rows: list[BatchRow] = []
        out: list[dict[str, Any] | BadRow | None] = [None] * n
        index: list[int] = []
        for i in range(n):
            record = {k: _python(v[i]) for k, v in columns.items()}
            line = int(record.pop("_line", None) or i + 1)
            settings = record.pop("_settings", None)
            if settings:
                record.update(json.loads(settings))
            if isinstance(record.get("messages"), str):
                record["messages"] = json.loads(record["messages"])
            record = {k: v for k, v in record.items() if v is not None}
            for k in INT_FIELDS & record.keys():  # an int column with nulls reaches pandas/numpy as floats
                if isinstance(record[k], float) and record[k].is_integer():
                    record[k] = int(record[k])
            row = parse_record(line, record)
            if isinstance(row, BadRow):
                out[i] = row
            else:
                rows.append(row)
                index.append(i)
        with torch.inference_mode():
            for i, result in zip(index, self.engine.run(rows)):
                out[i] = result
        result_columns: dict[str, list[Any]] = {c: [] for c in self.columns}
        lines = [r.line for r in rows]
        for i, item in enumerate(out):
            assert item is not None
            if isinstance(item, BadRow):
                values = {"id": item.id, "error": item.error, "line": item.line}
            else:
                values = {**item, "usage": json.dumps(item["usage"]), "error": None,
                          "line": lines[index.index(i)]}
                if "prompt_logprobs" in item:  # nested entries as JSON text: one string column for Arrow
                    values["prompt_logprobs"] = json.dumps(item["prompt_logprobs"])
            for c in self.columns:
                result_columns[c].append(values.get(c))
        return result_columns


class RayEngine:
    """The engine of ``genkit batch --engine ray``: the job's rows run as one Ray Data pipeline with
    ``workers`` actors (one model each, loaded once); ``address`` is passed to ``ray.init`` when Ray
    is not yet initialised (``"auto"``: an existing cluster); ``num_cpus`` per actor (Ray gives
    torch as many threads); ``prompt_logprobs``: every row's prompt scored (:class:`Generator`). Reading and writing stay in the driver (see docs/batch.md): results
    stream back in input order and the job commits them chunk by chunk."""

    def __init__(self, model: str, generation_kwargs: dict[str, Any] | None = None, batch_size: int = 16,
                 workers: int = 1, address: str | None = None, tokenizer: str | None = None,
                 custom_generate: Any = None, trust_remote_code: bool | None = None, num_cpus: float = 1,
                 prompt_logprobs: int | None = None, **load_kwargs: Any) -> None:
        try:
            import ray
        except ImportError as exc:
            raise ImportError("--engine ray needs Ray Data: pip install 'genkit-lm[ray]'") from exc
        if workers < 1:
            raise ConfigError(f"`workers` must be >= 1; got {workers}")
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.workers = workers
        self.batch_size = batch_size
        self.num_cpus = num_cpus
        self.constructor = {"model": model, "tokenizer": tokenizer, "generation_kwargs": generation_kwargs,
                            "batch_size": batch_size, "custom_generate": custom_generate,
                            "trust_remote_code": trust_remote_code, "prompt_logprobs": prompt_logprobs,
                            **load_kwargs}

    def run(self, rows: list[BatchRow]) -> list[dict[str, Any] | BadRow]:
        return list(self.stream(rows))

    def stream(self, rows: Iterable[BatchRow]) -> Iterator[dict[str, Any] | BadRow]:
        """Every row's result, in input order, from one Ray Data pipeline over all of ``rows``."""
        import ray.data

        rows = list(rows)
        if not rows:
            return
        items = [{"_line": r.line, "id": r.id, "prompt": r.prompt,
                  "messages": json.dumps(r.messages) if r.messages is not None else None,
                  "_settings": json.dumps(r.settings)} for r in rows]
        ctx = ray.data.DataContext.get_current()
        keep = ctx.execution_options.preserve_order
        ctx.execution_options.preserve_order = True  # results in input order: the driver buffers little
        try:
            ds = ray.data.from_items(items).map_batches(
                Generator, fn_constructor_kwargs=self.constructor,
                compute=ray.data.ActorPoolStrategy(size=self.workers), batch_size=self.batch_size,
                batch_format="pandas", num_cpus=self.num_cpus)
            got: dict[str, dict[str, Any]] = {}
            position = 0
            for result in ds.iter_rows():
                got.setdefault(str(result["id"]), result)  # a batch run again after a crash: once
                while position < len(rows) and rows[position].id in got:
                    yield self._result(rows[position], got.pop(rows[position].id))
                    position += 1
        finally:
            ctx.execution_options.preserve_order = keep
        for row in rows[position:]:
            found = got.get(row.id)
            yield self._result(row, found) if found is not None else \
                BadRow(row.line, row.id, "the Ray job returned no result for this row")

    @staticmethod
    def _result(row: BatchRow, got: dict[str, Any]) -> dict[str, Any] | BadRow:
        if got.get("error"):
            return BadRow(row.line, row.id, str(got["error"]))
        out = {"id": row.id, "text": got["text"], "token_ids": [int(t) for t in got["token_ids"]],
               "finish_reason": got["finish_reason"], "usage": json.loads(got["usage"])}
        if got.get("prompt_logprobs") is not None:
            out["prompt_logprobs"] = json.loads(got["prompt_logprobs"])
        return out
