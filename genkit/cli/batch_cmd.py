"""``genkit batch INPUT OUTPUT``: generate for every row of a JSONL or Parquet file (see docs/batch.md)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import ConfigError
from .generate_cmd import DEFAULT_MODEL, add_generation_options
from .heap import freeze_loaded_heap

ENGINES = ("local", "ray")
BATCHING = ("auto", "continuous", "static")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "batch",
        help="generate for every row of a JSONL or Parquet file",
        description=(
            "Read rows {\"id\": ..., \"prompt\": ...} or {\"id\": ..., \"messages\": [...]} (plus any per-row "
            "generation fields) from INPUT and write {\"id\", \"text\", \"token_ids\", \"finish_reason\", \"usage\"} "
            "rows to OUTPUT (JSONL or Parquet, each by its extension), in committed chunks: re-running with the same OUTPUT skips the ids already written. "
            "Bad rows go to OUTPUT.errors.jsonl and do not stop the job."
        ),
    )
    p.add_argument("input", help="input file: .jsonl or .parquet")
    p.add_argument("output", help="output file: .jsonl or .parquet (resumed when it exists)")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model folder, .gguf file, Hub id 'org/name', or 'smollm2' (default: {DEFAULT_MODEL})")
    p.add_argument("--engine", default="local", choices=ENGINES, help="where to run (default: local)")
    p.add_argument("--batching", default="auto", choices=BATCHING,
                   help="the engine on each machine: 'continuous' batching, 'static' left-padded batches, or 'auto' (continuous "
                        "where the model and settings allow it; default: auto)")
    p.add_argument("--workers", type=int, default=None, help="Ray actors, one model each (--engine ray; default: 1)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (--engine ray): 'auto' or ray://host:port (default: a local Ray)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="rows per generate call, or per continuous batching step (default: 16)")
    p.add_argument("--chunk-size", type=int, default=256, help="rows per committed output chunk (default: 256)")
    p.add_argument("--max-line-bytes", type=int, default=None, metavar="N",
                   help="longest JSONL input line, in bytes; longer lines go to the errors file "
                        "(default: 1048576, 1 MiB)")
    p.add_argument("--custom-generate", metavar="REF", default=None,
                   help="a recipe (local folder or Hub 'org/repo[@rev]') or a registered strategy name")
    p.add_argument("--trust-remote-code", action="store_true", help="allow running a Hub recipe's code")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                   help="score every row's prompt too: each token's log-probability given the tokens before it, "
                        "its rank and K alternatives (0-20), in the output's prompt_logprobs")
    add_generation_options(p, several=False)  # one output row per input row
    p.set_defaults(func=run)


def _check_engine_options(args: argparse.Namespace) -> None:
    """Sizes >= 1; the local engine's model options refused with ``--engine ray``."""
    for name in ("batch_size", "chunk_size", "workers", "max_line_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for option, name in (("workers", "--workers"), ("ray_address", "--ray-address")):
        if args.engine == "local" and getattr(args, option) is not None:
            raise ConfigError(f"{name} applies to --engine ray (the local engine runs one model in this process); "
                              "add --engine ray or drop it")
    if args.engine == "ray" and args.threads is not None:
        raise ConfigError("--threads applies to --engine local; Ray gives each actor its CPUs (ray.init(num_cpus=))")
    for option, name in (("activation_digits", "--activation-digits"), ("numerics", "--numerics")):
        if args.engine == "ray" and getattr(args, option) is not None:
            raise ConfigError(f"{name} applies to --engine local (Ray actors load the model with its defaults)")


def _check_ray_scoring(args: argparse.Namespace) -> None:
    """``--prompt-logprobs`` on an encoder-decoder model refused before Ray starts (the actors would
    each refuse it): its ``config.json`` read (of a Hub model, only that file fetched)."""
    if args.prompt_logprobs is not None:
        from genkit.batch.engine import check_prompt_logprobs
        from genkit.models.loading import model_config

        config = model_config(args.model, args.revision)
        check_prompt_logprobs(args.prompt_logprobs, bool(getattr(config, "is_encoder_decoder", False)))


def job_settings(args: argparse.Namespace, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What makes the job's rows, recorded beside its committed chunks: resuming them with other
    settings is refused (docs/batch.md, "Committed chunks, resume, errors")."""
    model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    return {"model": model, "revision": args.revision, "dtype": args.dtype, "generation": kwargs,
            "custom_generate": args.custom_generate, "activation_digits": args.activation_digits,
            "numerics": args.numerics, "prompt_logprobs": args.prompt_logprobs}


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's stop): the job stops as on Ctrl-C, keeping its committed chunks."""


@contextmanager
def sigterm_stops_the_job() -> Iterator[None]:
    """While the job runs, SIGTERM raises :class:`Terminated` in the main thread (as Ctrl-C raises
    KeyboardInterrupt) so that the job stops between two commits, never halfway through writing one."""
    def stop(signum: int, frame: Any) -> None:
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    from .generate_cmd import check_options
    from .options import apply_threads_option

    _check_engine_options(args)
    kwargs = check_options(args)
    n = kwargs.get("num_return_sequences")
    if n is not None and n != 1:
        raise ConfigError(f"`num_return_sequences` (--set) must be 1 in genkit batch (one output row per input row); "
                          f"got {n}")
    if args.engine == "local":
        apply_threads_option(args)  # before torch loads
    import torch

    from genkit.batch import run_batch
    from genkit.batch.engine import check_prompt_logprobs
    from genkit.batch.job import check_job

    check_prompt_logprobs(args.prompt_logprobs, False)  # before the model loads (not before the threads)
    settings = job_settings(args, kwargs)
    check_job(args.input, args.output, settings)  # before the model loads

    if args.seed is not None:
        torch.manual_seed(args.seed)
    engine = _make_engine(args, kwargs)
    from .progress import BatchBar

    bar = BatchBar() if sys.stderr.isatty() else None
    try:
        with torch.inference_mode(), sigterm_stops_the_job():
            summary = run_batch(args.input, args.output, engine, chunk_size=args.chunk_size, progress=bar,
                                on_result=bar.result if bar is not None else None, settings=settings,
                                **({} if args.max_line_bytes is None else {"max_line_bytes": args.max_line_bytes}))
    except Terminated:
        return 128 + signal.SIGTERM
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(summary.to_dict()), file=sys.stderr)
    return 0


def _make_engine(args: argparse.Namespace, kwargs: dict[str, Any]) -> Any:
    """The job's engine: Ray actors (``--engine ray``) or the model loaded here."""
    import genkit

    trust = True if args.trust_remote_code else None
    if args.engine == "ray":
        from genkit.batch.continuous import check_batching
        from genkit.ray import RayEngine

        check_batching(args.batching, kwargs, args.custom_generate)  # before any actor loads a model
        _check_ray_scoring(args)

        if args.ray_address is None:
            import ray

            if not ray.is_initialized():
                ray.init(num_cpus=os.cpu_count(), log_to_driver=False)

        return RayEngine(args.model, kwargs, batch_size=args.batch_size, workers=args.workers or 1,
                         address=args.ray_address, custom_generate=args.custom_generate, trust_remote_code=trust,
                         revision=args.revision, dtype=args.dtype, device=args.device, batching=args.batching,
                         prompt_logprobs=args.prompt_logprobs)
    from genkit.batch import make_local_engine

    model = genkit.load_model(args.model, revision=args.revision, dtype=args.dtype, device=args.device,
                              trust_remote_code=trust, activation_digits=args.activation_digits,
                              numerics=args.numerics)
    tokenizer = genkit.load_tokenizer(args.model, revision=args.revision)
    engine = make_local_engine(model, tokenizer, kwargs, batch_size=args.batch_size,
                               custom_generate=args.custom_generate, trust_remote_code=trust, batching=args.batching,
                               prompt_logprobs=args.prompt_logprobs)
    freeze_loaded_heap()
    return engine
