"""``genkit serve``: an OpenAI-compatible HTTP server (needs the ``serve`` extra: Starlette and
uvicorn). See docs/serve.md. Nothing here is imported by ``import genkit``."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from .admission import DEFAULT_MAX_CONCURRENT_REQUESTS
from .engine import GenerateEngine, Request, RequestStream, TokenEvent

__all__ = ["GenerateEngine", "Request", "RequestStream", "TokenEvent", "build_app", "default_model_name"]


def default_model_name(ref: str) -> str:
    """The name clients use by default: a local model's folder or file name (never its path),
    else the reference as given (a Hub id, 'smollm2')."""
    path = Path(ref)
    if os.path.exists(ref):
        return path.stem if path.is_file() else path.resolve().name
    return ref


def build_app(model: str | object, *, tokenizer: object | None = None, model_name: str | None = None,
              trust_remote_code: bool = False, engine: object | None = None, policy: object | None = None,
              allowed_recipes: list[str] | None = None, max_model_len: int | None = None,
              chat_template: str | None = None, max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
              request_timeout: float | None = None, enable_tokenizer_info_endpoint: bool = False) -> object:
    """The ASGI app serving ``model`` (a loaded model, or anything ``genkit.load_model`` takes).
    ``policy``: a :class:`~genkit.serve.security.ServePolicy` (default: 127.0.0.1, no API key);
    the other settings are ``genkit serve``'s flags of the same names (docs/serve.md).
    ``max_concurrent_requests`` and ``request_timeout`` are checked before the model loads."""
    import genkit

    from .admission import Admission
    from .app import ServerState, create_app

    Admission(max_concurrent_requests, request_timeout)  # a bad value is said before the model loads

    if isinstance(model, str):
        name = model_name or default_model_name(model)
        tokenizer = tokenizer or genkit.load_tokenizer(model)
        model = genkit.load_model(model)
    else:
        name = model_name or "model"
    if tokenizer is None:
        raise ConfigError("`tokenizer` is needed with a loaded model")
    if engine is None:
        from .engines import make_engine

        engine = make_engine(model, tokenizer)
    state = ServerState(model, tokenizer, engine, name, trust_remote_code=trust_remote_code,
                        allowed_recipes=allowed_recipes, policy=policy, max_model_len=max_model_len,  # type: ignore[arg-type]
                        chat_template=chat_template, max_concurrent_requests=max_concurrent_requests,
                        request_timeout=request_timeout, enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint)
    app = create_app(state)
    app.state.genkit = state
    return app
