"""Chat templates (a model's jinja2 ``chat_template``) rendered in a sandbox with budgets.

A template comes with the model's files, so it is hostile input like them: jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` keeps it away from Python's internals and from
mutating what it is given, but not from spending time or memory: nested loops over ``range(100000)``
run for hours, ``"x" * 10**10`` or ``"%999999999999s"|format(x)`` allocate before anything looks. So a
render here counts, before the work is done:

- loop iterations, all loops of one render together: :data:`MAX_LOOPS` (a real template iterates over
  the messages and tools: thousands);
- the length of every string or list ``*``, ``+``, ``~`` (concatenation) and the size-taking filters
  (``center``, ``indent``, ``wordwrap``, ``format``, ``replace``) would make, and the rendered text:
  :data:`MAX_CHARS`; ``**`` with an exponent past :data:`MAX_EXPONENT`;
- recursion (a macro calling itself) ends in an error, not a crash.

The environment is transformers' (``apply_chat_template``): ``trim_blocks``, ``lstrip_blocks``, the
loop controls (``break``, ``continue``), ``raise_exception``, ``strftime_now``, ``tojson`` with
``ensure_ascii=False`` / ``indent`` / ``separators`` / ``sort_keys`` (its size checked first), a
``namespace`` that refuses ``_``-prefixed attributes, and the ``{% generation %}`` tag that marks
the assistant's text (:func:`render_with_spans` returns those spans).

Past a budget the render stops with a :class:`~genkit.errors.ConfigError` naming the budget.
"""

from __future__ import annotations

import contextvars
import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import ConfigError

__all__ = ["MAX_CHARS", "MAX_EXPONENT", "MAX_LOOPS", "plain_data", "render", "render_conversation", "render_with_spans",
           "template_variables", "tool_schemas"]

MAX_LOOPS = 1_000_000
MAX_CHARS = 16 * 2**20
MAX_EXPONENT = 4096

_loops: contextvars.ContextVar[list[int]] = contextvars.ContextVar("genkit_chat_template_loops")
_spans: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("genkit_chat_template_spans")


def render(template: str, **variables: Any) -> str:
    """``template`` rendered with ``variables``; a :class:`ConfigError` when it does not compile, raises
    (``raise_exception``), recurses without end or goes past a budget (see the module docstring)."""
    return render_with_spans(template, **variables)[0]


def render_with_spans(template: str, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """:func:`render`, and the ``(start, end)`` character spans of the text the template wrapped in
    ``{% generation %}`` ... ``{% endgeneration %}`` (the assistant's turns), as transformers counts
    them for ``return_assistant_tokens_mask``."""
    from jinja2.exceptions import TemplateError

    token = _loops.set([0])
    state: list[Any] = [0, []]  # characters rendered so far, the generation spans
    spans_token = _spans.set(state)
    try:
        out: list[str] = []
        for piece in _compile(template).generate(**variables):
            state[0] += len(piece)
            _check_size(state[0], "the rendered text")
            out.append(piece)
        return "".join(out), state[1]
    except ConfigError:
        raise
    except TemplateError as exc:
        raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
    except RecursionError:
        raise ConfigError("the chat template recurses without end (a macro calling itself)") from None
    except OverflowError as exc:  # the sandbox's range limit
        raise ConfigError(f"the chat template asks for too much: {exc}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:  # None iterated, 1/0...
        raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        _spans.reset(spans_token)
        _loops.reset(token)


def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from outside (``messages``, ``tools``, ``enable_thinking``...);
    empty when it does not compile (rendering reports that)."""
    import jinja2.meta
    from jinja2.exceptions import TemplateError

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_compile(template).environment.parse(template)))
    except TemplateError:
        return frozenset()


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise ConfigError(f"the chat template would make {what} of {n} characters or items; the budget is "
                          f"{MAX_CHARS} (genkit.chat_template.MAX_CHARS)")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _counted(iterable: Any) -> Any:
    """``iterable``'s items, each counted against the render's :data:`MAX_LOOPS`."""
    count = _loops.get()
    for item in iterable:
        count[0] += 1
        if count[0] > MAX_LOOPS:
            raise ConfigError(f"the chat template ran more than {MAX_LOOPS} loop iterations "
                              "(genkit.chat_template.MAX_LOOPS)")
        yield item


def _concat(*parts: Any) -> str:
    _check_size(sum(len(str(p)) if isinstance(p, str) else 0 for p in parts), "a string")
    return "".join(str(p) for p in parts)


_WIDTHS = re.compile(r"%[-+ #0]*(\d+)?(?:\.(\d+))?")  # printf-style: %10.3f
_SPECS = re.compile(r"\{[^{}]*:([^{}]*)\}")  # str.format's: {:>10}, {0:.3}


def _check_widths(fmt: Any) -> None:
    """The widths and precisions a format string asks for (``%`` or ``str.format`` style), each
    within :data:`MAX_CHARS`, before it is formatted."""
    text = str(fmt)
    numbers = [g for m in _WIDTHS.finditer(text) for g in m.groups() if g]
    numbers += [n for m in _SPECS.finditer(text) for n in re.findall(r"\d+", m.group(1))]
    for n in numbers:
        _check_size(int(n), "a formatted field")


def _guard(original: Any, check: Any) -> Any:
    """The filter ``original`` calling ``check`` with its own arguments (not the environment or
    context jinja passes first to some filters) before it runs."""
    passed = getattr(original, "jinja_pass_arg", None)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        check(*(args[1:] if passed is not None else args), **kwargs)
        return original(*args, **kwargs)

    if passed is not None:
        guarded.jinja_pass_arg = passed  # type: ignore[attr-defined]
    return guarded


def _center(s: Any, width: int = 80) -> None:
    _check_size(max(_sized(s), int(width)), "a string")


def _indent(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    lines = str(s).count("\n") + 1
    _check_size(len(str(s)) + lines * (len(width) if isinstance(width, str) else int(width)), "a string")


def _wordwrap(s: Any, width: int = 79, *args: Any, **kwargs: Any) -> None:
    _check_size(int(width), "a line")


def _format(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_widths(value)


def _replace(s: Any, old: Any, new: Any, count: int | None = None) -> None:
    text, old, new = str(s), str(old), str(new)
    hits = text.count(old) if old else len(text) + 1
    hits = hits if count is None or count < 0 else min(hits, count)
    _check_size(len(text) + hits * max(0, len(new) - len(old)), "a string")


def _join(value: Any, d: Any = "", attribute: Any = None) -> None:
    if isinstance(value, (list, tuple)) and isinstance(d, str):
        _check_size(max(0, len(value) - 1) * len(d), "a string")


def _groups(value: Any, count: int, fill_with: Any = None) -> None:  # batch, slice: `count`-long groups or lists
    _check_size(int(count), "a list")


def _checked_filters(filters: dict[str, Any]) -> dict[str, Any]:
    """The filters that take a size, checking what they would make first."""
    checks = {"center": _center, "indent": _indent, "wordwrap": _wordwrap, "format": _format, "replace": _replace,
              "join": _join, "batch": _groups, "slice": _groups}
    return {name: _guard(filters[name], check) for name, check in checks.items()}


def _budgeted(ast: Any) -> Any:
    """The parsed template with every loop's iterable counted (:func:`_counted`) and every
    ``~`` concatenation checked (:func:`_concat`)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def call(name: str, args: list[Any], lineno: int) -> Any:
        return nodes.Call(nodes.Name(name, "load", lineno=lineno), args, [], None, None, lineno=lineno)

    class Budget(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = call("_genkit_counted", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return call("_genkit_concat", list(node.nodes), node.lineno)

    return Budget().visit(ast)


def _json_shape(value: Any) -> tuple[int, int]:
    """The number of values in ``value`` (a JSON-like structure) and its nesting depth."""
    count, depth, stack = 0, 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        count, depth = count + 1, max(depth, level)
        _check_size(count, "a JSON value")
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, level + 1) for v in item)
    return count, depth


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter as transformers defines it (``json.dumps``, not jinja's HTML-escaping
    one), the indentation and separators it would write checked against :data:`MAX_CHARS` first."""
    width = len(indent) if isinstance(indent, str) else int(indent or 0)
    seps = sum(len(str(x)) for x in separators) if isinstance(separators, (list, tuple)) else 0
    if width or seps:
        count, depth = _json_shape(value)
        _check_size(count * (width * depth + seps + 1), "a JSON text")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:  # noqa: A002 (transformers' name)
    """The current local time, formatted (transformers' ``strftime_now``: Llama 3.x's date)."""
    for width in re.findall(r"%[-_0^#]*(\d+)", str(format)):
        _check_size(int(width), "a formatted field")
    return datetime.now().strftime(format)


def _generation_extension() -> Any:
    """The ``{% generation %}`` ... ``{% endgeneration %}`` tag: renders its body, and records the
    body's span in the rendered text (:func:`render_with_spans`)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

        def _span(self, caller: Any) -> str:
            text = caller()
            state = _spans.get(None)
            if state is not None:
                state[1].append((state[0], state[0] + len(text)))
            return text

    return Generation


def _namespace() -> Any:
    """jinja's ``namespace``, refusing ``_``-prefixed attributes (a way into Python's internals),
    as transformers' is."""
    from jinja2.exceptions import SecurityError
    from jinja2.utils import Namespace

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                                f"got {name!r}. Please rename the attribute.")

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature: namespace(self=...))
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type's other attributes (transformers')."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Budgeted(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _sized(seq) and isinstance(n, int):
                        _check_size(len(seq) * n, "a string or list")
            elif operator == "+":
                _check_size(_sized(left) + _sized(right), "a string or list")
            elif operator == "%":
                if isinstance(left, str):
                    _check_widths(left)
            elif isinstance(right, int) and abs(right) > MAX_EXPONENT and isinstance(left, int) and abs(left) > 1:
                raise ConfigError(f"the chat template raises to the power {right}; the budget is {MAX_EXPONENT} "
                                  "(genkit.chat_template.MAX_EXPONENT)")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
            inner = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            if isinstance(getattr(inner, "__self__", None), str) and getattr(inner, "__name__", "") in (
                    "format", "format_map"):
                _check_widths(inner.__self__)
            return super().call(__context, __obj, *args, **kwargs)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters.update(_checked_filters(env.filters))
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=_TemplateDict(),
                       namespace=_namespace(), _genkit_counted=_counted, _genkit_concat=_concat)
    env.globals.pop("lipsum", None)  # lipsum(n=10**9) writes n paragraphs; no chat template needs it
    return env.from_string(_budgeted(env.parse(template)))


# --- a conversation as transformers' apply_chat_template gives it to the template ---------------

# names a message's reasoning goes by; templates read the first (gpt-oss's read `thinking`)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def plain_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (as transformers does before a render): a template
    sees no object with methods of its own; dataclasses and pydantic models become dicts, anything
    else a ``"<TypeName>"`` placeholder."""
    import dataclasses
    from collections.abc import Mapping

    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy scalar
        return plain_data(value.item())
    return f"<{type(value).__name__}>"


def tool_schemas(tools: Any) -> list[Any] | None:
    """``tools`` as the template takes them: JSON-schema dicts as given; a Python function becomes its
    schema (transformers' ``get_json_schema``: type hints and a Google-style docstring)."""
    import inspect

    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ConfigError(f"`tools` must be a list of JSON-schema dicts or Python functions; got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict):
            out.append(tool)
        elif inspect.isfunction(tool) or inspect.ismethod(tool):
            try:
                from transformers.utils import get_json_schema
            except ImportError:
                raise ConfigError(f"`tools[{i}]` is a Python function; its JSON schema is made by transformers' "
                                  "get_json_schema (pip install 'genkit[transformers]'), or pass the schema "
                                  "dict itself") from None
            try:
                out.append(get_json_schema(tool))
            except Exception as exc:  # noqa: BLE001 - transformers' parsing errors are plain Exceptions
                raise ConfigError(f"`tools[{i}]` ({getattr(tool, '__name__', tool)!r}): {exc}") from exc
        else:
            raise ConfigError(f"`tools[{i}]` must be a JSON-schema dict or a Python function with type hints and "
                              f"a docstring; got {type(tool).__name__}")
    return plain_data(out)


def _messages(conversation: Any) -> list[dict[str, Any]]:
    """A conversation's messages as plain dicts, keys whose value is None dropped (OpenAI's
    ``content=None``), the reasoning copied under each of its names (transformers' normalization)."""
    if not isinstance(conversation, (list, tuple)):
        raise ConfigError("`conversation` must be a list of {'role': ..., 'content': ...} dicts")
    messages = []
    for i, message in enumerate(plain_data(list(conversation))):
        if not isinstance(message, dict):
            raise ConfigError(f"`conversation[{i}]` must be a {{'role': ..., 'content': ...}} dict; got "
                              f"{type(conversation[i]).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        messages.append(message)
    return messages


def _tag_final(messages: list[dict[str, Any]], template: str, field: str) -> str:
    """Mark the text of the final message's ``field`` that the render is to end with (transformers'
    ``continue_final_message``); returns that text."""
    final = messages[-1].get(field)
    if final is None:
        raise ConfigError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if messages[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ConfigError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                          "chat template")
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return str(text)
        raise ConfigError("continue_final_message is set but the final message has no text block to continue")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return str(final)


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ConfigError("continue_final_message is set but the final message does not appear in the chat after "
                          "applying the chat template (the template drops part of it)")
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def render_conversation(template: str, conversation: Any, *, tools: list[Any] | None = None,
                        documents: list[Any] | None = None, add_generation_prompt: bool = False,
                        continue_final_message: bool | str = False,
                        **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """One conversation rendered as transformers' ``apply_chat_template`` renders it: ``messages``,
    ``tools``, ``documents`` and ``add_generation_prompt`` always defined (None when not given), the
    messages normalized (:func:`_messages`), ``continue_final_message`` (True: the final message's
    ``content``; a string: that field) cutting the render at the end of the final message's text.
    Returns the text and its ``{% generation %}`` spans."""
    messages = _messages(conversation)
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise ConfigError("`documents` must be a list of dicts (with 'title' and 'text' keys)")
    final = None
    if continue_final_message:
        if not messages:
            raise ConfigError("continue_final_message is set but the conversation is empty")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final(messages, template, field)
    text, spans = render_with_spans(template, messages=messages, tools=tools, documents=plain_data(documents),
                                    add_generation_prompt=add_generation_prompt, **plain_data(variables))
    return (text if final is None else _cut_at_tag(text, final)), spans
