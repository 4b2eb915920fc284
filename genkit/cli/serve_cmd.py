"""``genkit serve``: an OpenAI-compatible server (the ``serve`` extra). No torch import at module
import time."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from ..errors import ConfigError
from .options import add_threads_option, apply_threads_option

logger = logging.getLogger("genkit.cli.serve")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over OpenAI's completions and chat completions API (needs "
                    "`pip install 'genkit-lm[serve]'`). See docs/serve.md.")
    p.add_argument("--model", "-m", default="smollm2", help="model folder, .gguf file, Hub id, or 'smollm2'")
    p.add_argument("--model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="token budget of one batching step (continuous batching engine)")
    p.add_argument("--scheduler", default=None, help="continuous batching scheduler: fifo or prefill_first")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let requests run recipes (custom_generate); without it only registered strategies and "
                        "Hub recipes covered by a trusted-repos entry run")
    add_threads_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("`genkit serve` needs the serve extra: pip install 'genkit-lm[serve]'") from exc
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be between 1 and 65535; got {args.port}")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise ConfigError(f"--max-batch-tokens must be >= 1; got {args.max_batch_tokens}")
    apply_threads_option(args)
    import genkit
    from genkit.serve import build_app
    from genkit.serve.engines import make_engine

    model = genkit.load_model(args.model, dtype=args.dtype)
    tokenizer = genkit.load_tokenizer(args.model)
    engine = make_engine(model, tokenizer, scheduler=args.scheduler, max_batch_tokens=args.max_batch_tokens)
    app: Any = build_app(model, tokenizer=tokenizer, model_name=args.model_name or args.model,
                         trust_remote_code=args.trust_remote_code, engine=engine)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    state = app.state.genkit

    def stop(signum: int, frame: Any) -> None:  # graceful: refuse new requests, let running ones finish
        state.shutting_down = True
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    config_install = server.install_signal_handlers if hasattr(server, "install_signal_handlers") else None
    if config_install is not None:
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    print(f"genkit serve: {args.model} on http://{args.host}:{args.port}/v1 ({engine.name} engine)", flush=True)
    server.run()
    engine.shutdown(timeout=30)
    return 0
