"""Structured outputs in ``genkit serve``: ``response_format`` and vLLM's ``guided_json``,
``guided_regex``, ``guided_grammar``, ``guided_choice``.

They are generation fields (declared by the built-in structured-output processor,
:mod:`genkit.builtin_strategies.structured`), so a request passes them to ``generate`` as they are;
this module checks them when the request arrives, so that a bad schema, regex or grammar (or a
server without the ``structured`` extra) is a 400 naming the field before any work is queued.
"""

from __future__ import annotations

from typing import Any

from .openai_api import APIError

__all__ = ["check_structured", "constrain"]


def constrain(kwargs: dict[str, Any], tools: Any = None) -> None:
    """Add the constraint a ``tool_choice`` of ``"required"`` or a named function runs with
    (``tools``: a :class:`~genkit.serve.tools.ToolPlan` or None) to ``kwargs``, then check the
    structured-output fields."""
    from genkit.builtin_strategies.structured import STRUCTURED_FIELDS

    forced = tools.generate_kwargs() if tools is not None else {}
    if forced:
        clash = [k for k in STRUCTURED_FIELDS if kwargs.get(k) is not None]
        if clash:
            raise APIError(f"`tool_choice` {tools.choice!r} constrains the output itself; it cannot be combined "
                           f"with `{clash[0]}`", "tool_choice")
        kwargs.update(forced)
    check_structured(kwargs)


def check_structured(kwargs: dict[str, Any]) -> None:
    """Raise :class:`APIError` (400, ``param`` the field) unless the request's structured-output
    fields compile."""
    from genkit.builtin_strategies.structured import STRUCTURED_FIELDS, compile_grammar, grammar_request
    from genkit.config import GenerationConfig
    from genkit.errors import GenkitError

    given = [k for k in STRUCTURED_FIELDS if kwargs.get(k) is not None]
    if not given:
        return
    try:
        request = grammar_request(GenerationConfig(**{k: kwargs[k] for k in given}))
        if request is not None:
            compile_grammar(request[1], request[2], request[0])
    except GenkitError as exc:
        message = str(exc)
        param = next((k for k in given if f"`{k}`" in message), given[0])
        raise APIError(message, param) from exc
