"""``genkit serve``: an OpenAI-compatible server (the ``serve`` extra). No torch import at module
import time.

Every option is checked, and the port bound, before the model loads: a typo or a port in use is
said at once.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from ..errors import ConfigError
from .options import (
    add_activation_digits_option,
    add_chat_template_option,
    add_device_option,
    add_numerics_option,
    add_threads_option,
    apply_threads_option,
    check_activation_digits_option,
    check_device_option,
    check_numerics_option,
    check_threads_option,
    read_chat_template,
)

logger = logging.getLogger("genkit.cli.serve")
# what the warm-up request reads (--no-warmup: none): a few tokens of ordinary text
WARM_UP_TEXT = "The quick brown fox jumps over the lazy dog."

_API_KEY_ENV = "GENKIT_API_KEY"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over OpenAI's completions and chat completions API (needs "
                    "`pip install 'genkit-lm[serve]'`). Locked down by default: 127.0.0.1 only, JSON bodies only, "
                    "the Host header checked, no cross-origin browser requests, no recipes. See docs/serve.md.")
    p.add_argument("model", nargs="?", default=None, help="model folder, .gguf file, Hub id, or 'smollm2' (default)")
    p.add_argument("--model", "-m", dest="model_option", default=None, help="the model, as an option")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="the name clients send as `model` (default: the model's folder or file name, or its Hub id)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${_API_KEY_ENV})")
    p.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="Host header names accepted besides the bound address (comma-separated, repeatable; '*': any)")
    p.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                   help="browser origins allowed to call the server (CORS), e.g. https://app.example "
                        "(comma-separated, repeatable; '*': any)")
    p.add_argument("--allowed-recipes", action="append", default=[], metavar="IDS",
                   help="Hub recipes (org/name or org/name@revision) requests may run as custom_generate; "
                        "needs --trust-remote-code (comma-separated, repeatable)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let requests run the recipes --allowed-recipes lists")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens of prompt + completion per request (default: the model's context)")
    add_chat_template_option(p)
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the special tokens and the chat template, vLLM's), which "
                        "clients that tokenize through /tokenize read (lm-evaluation-harness)")
    p.add_argument("--max-body-size", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                   help="largest request body (default: 4 MiB)")
    p.add_argument("--max-concurrent-requests", type=int, default=128, metavar="N",
                   help="completion requests admitted at once, running or waiting (default: 128, TGI's); one more "
                        "is refused with a 429 and Retry-After")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open HTTP connections; one more is answered 503 (default: 2 x --max-concurrent-requests "
                        "+ 64)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop a completion request running longer (a stream ends with finish_reason \"length\", "
                        "a response not yet begun is a 504; default: none)")
    p.add_argument("--write-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="close a connection whose client has not read its response for this long (a stream is "
                        "cancelled and its slot given back; default: 60)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, how long running requests may finish before they are cancelled "
                        "(default: 30)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"])
    add_device_option(p)
    _add_engine_options(p)
    add_threads_option(p)
    add_activation_digits_option(p)
    add_numerics_option(p)
    p.set_defaults(func=run)


def _add_engine_options(p: Any) -> None:
    """The continuous batching engine's options."""
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="token budget of one batching step (continuous batching engine)")
    p.add_argument("--scheduler", default=None, help="continuous batching scheduler: fifo or prefill_first")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up request run before the server listens (as llama-server's --no-warmup)")
    p.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="compute every prompt in full: no reuse of cached prompt prefixes between requests (on a "
                        "server shared by parties who must not learn from its timing what the others sent)")


def _listed(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _model_ref(args: argparse.Namespace) -> str:
    if args.model and args.model_option and args.model != args.model_option:
        raise ConfigError(f"the model is given twice: {args.model!r} and --model {args.model_option!r}; give one")
    return str(args.model or args.model_option or "smollm2")


def _check_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every option checked before anything loads; the settings the server needs."""
    from genkit.recipes.resolve import REPO_RE

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be between 1 and 65535; got {args.port}")
    for name in ("max_batch_tokens", "max_model_len", "max_body_size", "max_concurrent_requests", "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.max_connections is not None and args.max_connections <= args.max_concurrent_requests:
        raise ConfigError(f"--max-connections ({args.max_connections}) must be more than --max-concurrent-requests "
                          f"({args.max_concurrent_requests}): each admitted request holds a connection, and /health "
                          "needs one besides")
    for name in ("request_timeout", "write_timeout"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds > 0; got {value}")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds; got {args.shutdown_timeout}")
    recipes = _listed(args.allowed_recipes)
    bad = [r for r in recipes if not REPO_RE.fullmatch(r.partition("@")[0]) or ".." in r or r.startswith((".", "/"))]
    if bad:
        raise ConfigError(f"--allowed-recipes takes Hub ids 'org/name' or 'org/name@revision'; got {bad[0]!r}")
    if recipes and not args.trust_remote_code:
        raise ConfigError("--allowed-recipes needs --trust-remote-code (recipes run code on this machine)")
    if args.trust_remote_code and not recipes:
        raise ConfigError("--trust-remote-code needs --allowed-recipes: the Hub recipes requests may run")
    api_key = args.api_key if args.api_key is not None else os.environ.get(_API_KEY_ENV)
    if api_key is not None and not api_key.strip():  # set, but to nothing: never served without a key
        raise ConfigError("--api-key is empty" if args.api_key is not None else
                          f"${_API_KEY_ENV} is set but empty: set it to the key, or unset it to serve without one")
    from genkit.serve.security import ServePolicy

    policy = ServePolicy(host=args.host, port=args.port, api_key=api_key, allowed_hosts=_listed(args.allowed_hosts),
                         allowed_origins=_listed(args.allowed_origins), max_body_bytes=args.max_body_size)
    return {"recipes": recipes, "api_key": api_key, "chat_template": read_chat_template(args.chat_template),
            "policy": policy}


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as exc:
        raise ImportError("`genkit serve` needs the serve extra: pip install 'genkit-lm[serve]'") from exc
    ref = _model_ref(args)
    settings = _check_options(args)
    check_threads_option(args)
    check_activation_digits_option(args)
    check_numerics_option(args)
    check_device_option(args)
    from genkit.serve.lifecycle import DrainingServer, bind, connection_limits

    from .heap import freeze_loaded_heap

    sock = bind(args.host, args.port)
    try:
        apply_threads_option(args)
        app, engine = _load(args, ref, settings)
    except BaseException:
        sock.close()
        raise
    freeze_loaded_heap()
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                            **connection_limits(args.max_connections, args.max_concurrent_requests,
                                                write_timeout=args.write_timeout))
    server = DrainingServer(config, app.state.genkit, args.shutdown_timeout)
    print(f"genkit serve: {app.state.genkit.model_name} on http://{args.host}:{args.port}/v1 ({engine.name} engine"
          f"{', API key required' if settings['api_key'] else ''})", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown(timeout=args.shutdown_timeout)
    return 0


def _warm_up(engine: Any, tokenizer: Any) -> None:
    """The engine's warm-up request (:data:`WARM_UP_TEXT`); one that cannot run is logged, not fatal."""
    from genkit.errors import GenkitError

    ids = list(tokenizer(WARM_UP_TEXT)["input_ids"])
    try:
        took = engine.warm_up(ids)
    except GenkitError as exc:
        logger.warning("no warm-up request: %s", exc)
        return
    if took is not None:
        logger.info("warmed up: a greedy request of %d prompt tokens in %.1f ms", len(ids), took * 1e3)


def _load(args: argparse.Namespace, ref: str, settings: dict[str, Any]) -> tuple[Any, Any]:
    import genkit
    from genkit.serve import build_app, default_model_name
    from genkit.serve.engines import make_engine
    from genkit.serve.limits import position_limit

    model = genkit.load_model(ref, dtype=args.dtype, device=args.device, activation_digits=args.activation_digits,
                              numerics=args.numerics)
    tokenizer = genkit.load_tokenizer(ref)
    context = position_limit(model)
    if args.max_model_len is not None and context is not None and args.max_model_len > context:
        raise ConfigError(f"--max-model-len {args.max_model_len} is over the model's context of {context} tokens")
    engine = make_engine(model, tokenizer, scheduler=args.scheduler, max_batch_tokens=args.max_batch_tokens,
                         prompt_cache=args.prompt_cache)
    if args.warmup:
        _warm_up(engine, tokenizer)
    app: Any = build_app(model, tokenizer=tokenizer, model_name=args.model_name or default_model_name(ref),
                         trust_remote_code=args.trust_remote_code, engine=engine, policy=settings["policy"],
                         allowed_recipes=settings["recipes"], max_model_len=args.max_model_len,
                         chat_template=settings["chat_template"],
                         max_concurrent_requests=args.max_concurrent_requests, request_timeout=args.request_timeout,
                         enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    return app, engine
