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

Past a budget the render stops with a :class:`~genkit.errors.ConfigError` naming the budget.
"""

from __future__ import annotations

import contextvars
import json
import re
from functools import lru_cache
from typing import Any

from .errors import ConfigError

__all__ = ["MAX_CHARS", "MAX_EXPONENT", "MAX_LOOPS", "render"]

MAX_LOOPS = 1_000_000
MAX_CHARS = 16 * 2**20
MAX_EXPONENT = 4096

_loops: contextvars.ContextVar[list[int]] = contextvars.ContextVar("genkit_chat_template_loops")


def render(template: str, **variables: Any) -> str:
    """``template`` rendered with ``variables``; a :class:`ConfigError` when it does not compile, raises
    (``raise_exception``), recurses without end or goes past a budget (see the module docstring)."""
    from jinja2.exceptions import TemplateError

    token = _loops.set([0])
    try:
        out: list[str] = []
        size = 0
        for piece in _compile(template).generate(**variables):
            size += len(piece)
            _check_size(size, "the rendered text")
            out.append(piece)
        return "".join(out)
    except TemplateError as exc:
        raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
    except RecursionError:
        raise ConfigError("the chat template recurses without end (a macro calling itself)") from None
    except OverflowError as exc:  # the sandbox's range limit
        raise ConfigError(f"the chat template asks for too much: {exc}") from None
    finally:
        _loops.reset(token)


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

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters.update(_checked_filters(env.filters))
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, _genkit_counted=_counted, _genkit_concat=_concat)
    env.globals.pop("lipsum", None)  # lipsum(n=10**9) writes n paragraphs; no chat template needs it
    return env.from_string(_budgeted(env.parse(template)))
