"""Chat templates (a model's jinja2 ``chat_template``) rendered in a sandbox with budgets.

A template comes with the model's files, so it is hostile input like them: jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` keeps it away from Python's internals and from
mutating what it is given, but not from spending time or memory: nested loops over ``range(100000)``
run for hours, ``"x" * 10**10`` or ``"%999999999999s"|format(x)`` allocate before anything looks, and
a list of 4000 references to a list of 4000 references to a list of 4000 zeros is three small lists
whose text is 192 GB. So a render here counts, before the work is done:

- each operation's result: the length of every string or list ``*``, ``+``, ``~`` (concatenation),
  ``%``, ``str.format``, a slice, the filters and the ``str`` methods that make one (``center``,
  ``indent``, ``replace``, ``join``, ``batch``...) would make, at most :data:`MAX_CHARS` characters or
  items; integers of at most :data:`MAX_INT_BITS` bits from ``*`` and ``**``, exponents at most
  :data:`MAX_EXPONENT`;
- the text of every value made into text (``{{ value }}``, ``~``, ``%``, ``format``, ``string``,
  ``join``, ``tojson``, ``pprint``...) or compared (``==``, ``in``, ``sort``, ``unique``...): a walk
  of its containers that stops as soon as it passes :data:`MAX_CHARS` measures it before ``str()``
  or ``json.dumps`` runs (:func:`_measure`);
- the render's totals: loop iterations, all loops together, at most :data:`MAX_LOOPS`; the
  characters and items all its operations make together, at most :data:`MAX_MADE` (a new object in
  a result, such as a string in the list ``split`` makes, counts as :data:`_OBJECT` items);
  :data:`MAX_SECONDS` of CPU time, a backstop for work that makes nothing (a scan of a long string
  in each iteration);
- recursion (a macro calling itself) ends in an error, not a crash; a ``MemoryError`` is an error.

The environment is transformers' (``apply_chat_template``): ``trim_blocks``, ``lstrip_blocks``, the
loop controls (``break``, ``continue``), ``raise_exception``, ``strftime_now``, ``tojson`` with
``ensure_ascii=False`` / ``indent`` / ``separators`` / ``sort_keys`` (its size checked first), a
``namespace`` that refuses ``_``-prefixed attributes, and the ``{% generation %}`` tag that marks
the assistant's text (:func:`render_with_spans` returns those spans).

Past a budget the render stops with a :class:`~genkit.errors.ConfigError` that says the template is
too costly and names the budget (``genkit.chat_template.MAX_...``). The budgets are module constants,
read at each render: a caller may change them (tests lower them to keep their cases small).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import ConfigError

__all__ = ["MAX_CHARS", "MAX_EXPONENT", "MAX_INT_BITS", "MAX_LOOPS", "MAX_MADE", "MAX_SECONDS", "plain_data", "render",
           "render_conversation", "render_with_spans", "template_variables", "tool_schemas"]

#: loop iterations of one render, all loops together (a real template iterates over the messages
#: and tools: thousands)
MAX_LOOPS = 1_000_000
#: characters or items of any one string, list or text a template makes (and of the rendered text)
MAX_CHARS = 16 * 2**20
#: characters or items all the operations of one render make together, garbage included: four
#: values of the largest size; about 512 MB at most (8 bytes an item), and seconds of copying. Real
#: templates make 2 to 4.5 times the text they render (tests/test_chat_template_corpus.py checks 5)
MAX_MADE = 4 * MAX_CHARS
#: CPU seconds of one render (the rendering thread's), checked every few million units of work: a
#: backstop for work that makes nothing; real templates take milliseconds
MAX_SECONDS = 10.0
#: the largest exponent of ``**`` on an integer
MAX_EXPONENT = 4096
#: bits of an integer ``*`` or ``**`` makes (Python prints at most 4300 digits, 14,000 bits)
MAX_INT_BITS = 2**16

_OBJECT = 8  # a new object in a result (a string in a list, a list in a batch) counts as 8 items: ~64 bytes
_LOOP_WORK = 1024  # units of work a loop iteration counts for (a unit: about a character copied or scanned)
_WALK_WORK = 32  # ... and a value visited by _measure
_CLOCK_EVERY = 2**22  # units of work between two looks at the CPU clock
_SMALL = 64  # a string or list shorter than this is not counted where the common operations make one (+, ~,
# {{ }}, a loop's text): a loop iteration or a call counts for far more work, and what a template keeps
# grows by operations whose results are not small


class _Account:
    """One render's running totals (:func:`render_with_spans` makes one per render)."""

    __slots__ = ("deadline", "loops", "made", "rendered", "spans", "work")

    def __init__(self) -> None:
        self.loops = self.made = self.rendered = self.work = 0
        self.spans: list[tuple[int, int]] = []
        self.deadline = time.thread_time() + MAX_SECONDS


_account: contextvars.ContextVar[_Account] = contextvars.ContextVar("genkit_chat_template_account")


def render(template: str, **variables: Any) -> str:
    """``template`` rendered with ``variables``; a :class:`ConfigError` when it does not compile, raises
    (``raise_exception``), recurses without end or goes past a budget (see the module docstring)."""
    return render_with_spans(template, **variables)[0]


def render_with_spans(template: str, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """:func:`render`, and the ``(start, end)`` character spans of the text the template wrapped in
    ``{% generation %}`` ... ``{% endgeneration %}`` (the assistant's turns), as transformers counts
    them for ``return_assistant_tokens_mask``."""
    from jinja2.exceptions import TemplateError

    account = _Account()
    token = _account.set(account)
    try:
        out: list[str] = []
        for piece in _compile(template).generate(**variables):
            account.rendered += len(piece)
            _check_size(account.rendered, "the rendered text")
            out.append(piece)
        return "".join(out), account.spans
    except ConfigError:
        raise
    except TemplateError as exc:
        raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
    except RecursionError:
        raise ConfigError("the chat template recurses without end (a macro calling itself), or nests values "
                          "too deep to print or compare") from None
    except MemoryError:
        raise _too_costly("it ran out of memory (MemoryError); the budgets are genkit.chat_template.MAX_CHARS "
                          "and MAX_MADE") from None
    except OverflowError as exc:  # the sandbox's range limit
        raise ConfigError(f"the chat template asks for too much: {exc}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:  # None iterated, 1/0...
        raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        _account.reset(token)


def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from outside (``messages``, ``tools``, ``enable_thinking``...);
    empty when it does not compile (rendering reports that)."""
    import jinja2.meta
    from jinja2.exceptions import TemplateError

    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_compile(template).environment.parse(template)))
    except TemplateError:
        return frozenset()


# --- the budgets -------------------------------------------------------------------------------

def _too_costly(what: str) -> ConfigError:
    return ConfigError(f"the chat template is too costly: {what}")


def _check_size(n: int, what: str, *, verb: str = "make", at_least: bool = False) -> None:
    """``n`` characters or items (of ``what``) within :data:`MAX_CHARS`; ``at_least``: ``n`` is where
    a measure stopped."""
    if n > MAX_CHARS:
        raise _too_costly(f"it would {verb} {what} of {'at least ' if at_least else ''}{n} characters or items; "
                          f"the budget is {MAX_CHARS} (genkit.chat_template.MAX_CHARS)")


def _charge(made: int, work: int = 0) -> None:
    """``made`` characters or items (about to be made) counted against the render's :data:`MAX_MADE`;
    they and ``work`` (characters scanned, values compared) against its CPU clock's schedule."""
    account = _account.get(None)
    if account is None:  # not in a render (a filter called directly): the per-operation checks only
        return
    if made:
        account.made += made
        if account.made > MAX_MADE:
            _over_made(account)
    account.work += made + work
    if account.work > _CLOCK_EVERY:
        _clock(account)


def _over_made(account: _Account) -> None:
    raise _too_costly(f"it would make {account.made} characters or items in one render; the budget is {MAX_MADE} "
                      "(genkit.chat_template.MAX_MADE)")


def _clock(account: _Account) -> None:
    account.work = 0
    if time.thread_time() > account.deadline:
        raise _too_costly(f"it ran for more than {MAX_SECONDS} CPU seconds; the budget is {MAX_SECONDS} "
                          "(genkit.chat_template.MAX_SECONDS)")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _counted(iterable: Any, literal: int = 0) -> Any:
    """``iterable``'s items, each counted against the render's :data:`MAX_LOOPS`, and the ``literal``
    text of the loop's body (what each iteration writes besides its ``{{ }}``) against :data:`MAX_MADE`."""
    account = _account.get(None) or _Account()
    made = literal if literal >= _SMALL else 0
    for item in iterable:
        account.loops += 1
        if account.loops > MAX_LOOPS:
            raise _too_costly(f"it ran more than {MAX_LOOPS} loop iterations (genkit.chat_template.MAX_LOOPS)")
        _charge(made, _LOOP_WORK)
        yield item


# --- measuring a value's text before it is made -------------------------------------------------

_JSON_CONTROL = re.compile(r"[\x00-\x1f]")
_CONTAINERS = (list, tuple, dict, set, frozenset, type({}.keys()), type({}.values()), type({}.items()))
_SCALAR_SIZES = {float: 24, bool: 5, type(None): 4}  # repr(-1.2345678901234567e-308), False / false, None / null


@lru_cache(maxsize=1)
def _jinja_types() -> tuple[type, type]:
    from jinja2.runtime import Undefined
    from jinja2.utils import Namespace

    return Namespace, Undefined


def _int_size(n: int) -> int:
    return n.bit_length() * 78 // 256 + 2  # digits (78/256 > log10(2)) and a sign


def _quoted(s: str, style: str) -> int:
    """The length of ``s`` inside a container's text: ``repr(s)`` (``style`` ``"str"``) or its JSON
    (``"json"``, ``"json_ascii"`` with ``ensure_ascii``), escapes included (an upper estimate); for
    ``"compare"``, its length (what comparing it reads)."""
    n = len(s) + 2
    if style == "compare":
        return n
    if style == "str":
        n += s.count("\\") + s.count("'")
        if not s.isprintable():
            short = s.count("\n") + s.count("\r") + s.count("\t")
            rest = s.replace("\n", "").replace("\r", "").replace("\t", "") if short else s
            n += short if rest.isprintable() else 9 * len(s)  # \x.., \u...., \U........
        return n
    n += s.count('"') + s.count("\\")
    if not s.isprintable():
        controls = len(s) - len(_JSON_CONTROL.sub("", s))
        short = s.count("\n") + s.count("\r") + s.count("\t") + s.count("\b") + s.count("\f")
        n += short + 5 * (controls - short)  # \n, or \u0001
    if style == "json_ascii" and not s.isascii():
        n += 11 * (len(s) - len(s.encode("ascii", "ignore")))  # \ud83d\ude00
    return n


def _flat_size(items: Any, style: str, room: int) -> int | None:
    """The text of a list's or tuple's items when they are all scalars or all strings (measured at
    C speed); None when they are not."""
    types = set(map(type, items))
    if types <= {int, bool}:
        return sum(map(int.bit_length, items)) * 78 // 256 + 7 * len(items)
    if types <= {int, bool, float, type(None)}:
        return sum(_int_size(x) if type(x) is int else _SCALAR_SIZES.get(type(x), 5) for x in items) + 2 * len(items)
    if types == {str}:
        chars = sum(map(len, items))
        if chars > room or style == "compare":
            return chars + 4 * len(items)
        return _quoted("".join(items), style) + 4 * len(items)
    return None


def _measure(value: Any, limit: int, style: str = "str") -> tuple[int, int, int]:
    """``(size, count, depth)``: an upper estimate of the length of ``value``'s text (``str(value)``
    for ``style`` ``"str"``, ``json.dumps`` for ``"json"`` / ``"json_ascii"``; for ``"compare"``, the
    characters and values a comparison or a hash of it reads), the number of values in
    it (dict keys not counted) and its nesting depth; a walk of its containers, shared ones walked
    each time they are met (as their text repeats them), that stops as soon as ``size`` passes
    ``limit``, whatever the value's size. The values visited count as work."""
    Namespace, Undefined = _jinja_types()  # noqa: N806 (classes)
    if not isinstance(value, _CONTAINERS) and not isinstance(value, Namespace):  # holds nothing: at once
        return _leaf_size(value, style, Undefined), 1, 1
    if type(value) is dict:  # a message, a tool: strings, at once
        flat = _flat_size(value.values(), style, limit)
        if flat is not None:
            return 2 + 4 * len(value) + _keys_size(value, style, limit) + flat, len(value) + 1, 2

    size = count = depth = 0
    stack: list[Any] = [iter((value,))]
    opened: list[int] = [0]  # for each level of the stack, the id of the namespace it walks (or 0)
    walking: set[int] = set()  # ... those being walked: a namespace can hold itself, nothing else can
    try:
        while stack:
            level = len(stack)
            for item in stack[-1]:
                count += 1
                if level > depth:
                    depth = level
                kind = type(item)
                if kind is str:
                    size += _quoted(item, style)
                elif kind is int:
                    size += item.bit_length() * 78 // 256 + 2
                elif kind in _SCALAR_SIZES:
                    size += _SCALAR_SIZES[kind]
                elif isinstance(item, _CONTAINERS) or isinstance(item, Namespace):
                    grown, children, namespace, flat = _opened(item, kind, style, limit - size, Namespace, walking)
                    size += grown
                    if children is None:  # measured at once (flat items), or a namespace inside itself (-1)
                        if flat >= 0:
                            count, depth = count + flat, max(depth, level + 1)
                        if size > limit:
                            break
                        continue
                    stack.append(iter(children))
                    opened.append(namespace)
                    if namespace:
                        walking.add(namespace)
                    break
                else:
                    size += _leaf_size(item, style, Undefined, markup=True)
                if size > limit:
                    break
            else:
                stack.pop()
                walking.discard(opened.pop())
            if size > limit:
                break
    finally:
        _charge(0, count * _WALK_WORK)
    return size, count, depth


def _leaf_size(value: Any, style: str, undefined: Any, markup: bool = False) -> int:
    """:func:`_measure`'s size of a value that holds nothing: a string's text (quoted but for ``"str"``;
    ``markup``: inside a container, a str subclass is a ``Markup('...')``), an int's digits, bytes'
    escapes, an undefined value's, another object's repr (``<Macro 'x'>``, ``<generator ...>``)."""
    kind = type(value)
    if isinstance(value, str):
        return (len(value) if style == "str" and not markup else _quoted(value, style)) + (8 if markup else 0)
    if kind is int:
        return _int_size(value)
    return _SCALAR_SIZES.get(kind) or (9 if isinstance(value, undefined) else 4 * len(value) + 3
                                       if isinstance(value, (bytes, bytearray)) else 64)


def _opened(item: Any, kind: type, style: str, room: int, namespace_type: type,
            walking: set[int]) -> tuple[int, Any, int, int]:
    """A container :func:`_measure`'s walk meets: ``(size of its own text, its children to walk or None,
    the id of the namespace it is (0: none), the items measured at once)``: a message's or a long list's
    strings measured at once (children None), a namespace being walked met again inside itself
    (children None, -1 items)."""
    size = namespace = 0
    if isinstance(item, namespace_type):
        item = object.__getattribute__(item, "_Namespace__attrs")
        namespace = id(item)
        size += 13  # <Namespace {...}>
        if namespace in walking:
            return size, None, namespace, -1
    if isinstance(item, dict):
        size += 2 + 4 * len(item) + _keys_size(item, style, room - size)
        flat = _flat_size(item.values(), style, room - size)  # a message: strings
        return (size + flat, None, namespace, len(item)) if flat is not None else (size, item.values(), namespace, 0)
    size += (16 if isinstance(item, _CONTAINERS[5:]) else 2) + 2 * len(item)  # dict_items([...])
    if isinstance(item, tuple) and kind is not tuple:
        size += 32  # a named tuple's names
    flat = _flat_size(item, style, room - size) if len(item) > 8 else None
    return (size + flat, None, namespace, len(item)) if flat is not None else (size, item, namespace, 0)


def _keys_size(d: dict[Any, Any], style: str, room: int) -> int:
    """The text of a dict's keys (strings as a rule)."""
    if not d:
        return 0
    if set(map(type, d)) == {str}:
        chars = sum(map(len, d))
        return chars + 2 * len(d) if chars > room or style == "compare" else _quoted("".join(d), style) + 2 * len(d)
    size = 0
    for key in d:
        if isinstance(key, _CONTAINERS):
            size += _measure(key, room - size, style)[0]
        else:
            size += _measure((key,), room - size, style)[0] + (2 if style != "str" else 0)  # json quotes 1 as "1"
        if size > room:
            break
    return size


def _text_of(value: Any, what: str = "the text of a value") -> int:
    """The length ``str(value)`` will have (measured, not made), within :data:`MAX_CHARS`."""
    kind = type(value)
    if kind is str:
        n = len(value)
        if n > MAX_CHARS:
            _check_size(n, what)
        return n
    if kind is int:
        return _int_size(value)
    if kind in _SCALAR_SIZES:
        return _SCALAR_SIZES[kind]
    n = _measure(value, MAX_CHARS)[0]
    _check_size(n, what, at_least=True)
    return n


_SIMPLE = frozenset([int, bool, float, type(None)])


def _compared(value: Any) -> Any:
    """``value``, its size checked before a comparison (``==``, ``in``, a dict key) walks it: comparing or
    hashing nested containers visits every value they hold, shared ones each time."""
    kind = type(value)
    if kind is str:
        if len(value) >= _SMALL:
            _charge(0, len(value))
    elif kind not in _SIMPLE:
        n = _measure(value, MAX_CHARS, "compare")[0]
        if n > MAX_CHARS:
            _check_size(n, "values", verb="compare", at_least=True)
    return value


def _members(value: Any) -> Any:
    """``value``, the right side of ``in``: a dict is hashed into (the left side is what is walked);
    a list's items are compared (:func:`_compared`)."""
    return value if type(value) is dict or (type(value) is str and len(value) < _SMALL) else _compared(value)


def _finalize(value: Any) -> Any:
    """What ``{{ value }}`` prints, its text measured and counted before ``str()`` makes it."""
    n = len(value) if type(value) is str else _text_of(value)
    if n >= _SMALL:
        _charge(n)
    return value


def _concat(*parts: Any) -> str:
    n = sum(len(p) if type(p) is str else _text_of(p) for p in parts)
    if n >= _SMALL:
        _check_size(n, "a string")
        _charge(n)
    return "".join(str(p) for p in parts)


_WIDTHS = re.compile(r"%[-+ #0]*(\d+)?(?:\.(\d+))?")  # printf-style: %10.3f
_SPECS = re.compile(r"\{[^{}]*:([^{}]*)\}")  # str.format's: {:>10}, {0:.3}


def _check_widths(fmt: Any) -> int:
    """The widths and precisions a format string asks for (``%`` or ``str.format`` style), each
    within :data:`MAX_CHARS`, before it is formatted; returns their sum."""
    text = fmt.decode("latin-1") if isinstance(fmt, (bytes, bytearray)) else str(fmt)
    numbers = [g for m in _WIDTHS.finditer(text) for g in m.groups() if g]
    numbers += [n for m in _SPECS.finditer(text) for n in re.findall(r"\d+", m.group(1))]
    for n in numbers:
        _check_size(int(n), "a formatted field")
    return sum(int(n) for n in numbers)


def _repr_size(value: Any, conversion: Any) -> int:
    """The text of ``value`` as a format writes it: ``str()``, or ``repr()`` / ``ascii()`` (``!r``, ``%r``)."""
    if conversion in ("r", "a") and isinstance(value, str):
        return 10 * len(value) + 2 if conversion == "a" and not value.isascii() else _quoted(value, "str")
    return _text_of(value)


def _fields(fmt: str) -> Any:
    """The replacement fields of a ``str.format`` string in the order they are resolved (a field's
    nested ones, ``{:{}}``, after it): ``(name, conversion, nested)``."""
    import _string  # the parser str.format uses

    for _, name, spec, conversion in _string.formatter_parser(fmt):
        if name is not None:
            yield name, conversion, False
            if spec and "{" in spec:
                yield from ((inner, c, True) for inner, c, _ in _fields(spec))


def _formatted(fmt: Any, args: Any, named: Any = None, braces: bool = False) -> int:
    """The length of ``fmt`` formatted (``str.format`` with ``braces``, else ``%``) with the positional
    ``args`` and the mapping ``named``, within :data:`MAX_CHARS`: the widths it writes (``%10s``, and
    those taken from the arguments: ``%*s``, ``{:{}}``) and the text of each argument each time a
    field names it (``{0}{0}``), measured before it is made."""
    named = named if isinstance(named, dict) else {}
    n = _check_widths(fmt) + _sized(fmt)
    if braces:
        auto = 0
        for name, conversion, nested in _fields(str(fmt)):
            head = re.match(r"[^.\[]*", name).group()  # type: ignore[union-attr]
            if head == "":
                head, auto = str(auto), auto + 1
            value = (args[int(head)] if int(head) < len(args) else None) if head.isdigit() else named.get(head)
            if nested:  # a width or fill taken from the arguments
                n += abs(value) if type(value) is int else _text_of(value)
            else:
                n += _repr_size(value, conversion)
            _check_size(n, "a string")
    else:
        text = fmt.decode("latin-1") if isinstance(fmt, (bytes, bytearray)) else str(fmt)
        conversion = "r" if "%r" in text or "%a" in text else "s"
        n += sum(_repr_size(a, conversion) for a in args)
        n += sum(_repr_size(named.get(key), conversion) for key in re.findall(r"%\((\w*)\)", text))
        if "*" in text:  # %*s: widths taken from the arguments
            n += sum(abs(a) for a in args if type(a) is int)
    _check_size(n, "a string")
    return n


def _int_result(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise _too_costly(f"it would make an integer of {bits} bits; the budget is {MAX_INT_BITS} "
                          "(genkit.chat_template.MAX_INT_BITS)")


def _binop(operator: str, left: Any, right: Any) -> int:
    """What ``left operator right`` makes, checked (a ConfigError past a budget) before it is made."""
    ints = type(left) is int and type(right) is int
    if operator == "*":
        if ints:
            _int_result(left.bit_length() + right.bit_length())
            return 0
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) and isinstance(n, int):
                _check_size(len(seq) * n, "a string or list")
                return max(0, len(seq) * n)
    elif operator == "+":
        n = _sized(left) + _sized(right)
        _check_size(n, "a string or list")
        return n
    elif operator == "%":
        if isinstance(left, (str, bytes)):  # '%(a)s' % {...} names its values; '%s' % {...} prints the dict
            keyed = isinstance(right, dict) and "%(" in (left.decode("latin-1") if isinstance(left, bytes) else left)
            return _formatted(left, () if keyed else right if isinstance(right, tuple) else (right,), right)
    elif isinstance(right, int) and abs(right) > MAX_EXPONENT and isinstance(left, int) and abs(left) > 1:
        raise _too_costly(f"it raises to the power {right}; the budget is {MAX_EXPONENT} "
                          "(genkit.chat_template.MAX_EXPONENT)")
    elif ints and right > 0 and abs(left) > 1:
        _int_result(left.bit_length() * right)
    return 0


def _slice(value: Any, start: Any, stop: Any, step: Any) -> Any:
    """``value[start:stop:step]``, its length counted before the copy is made."""
    where = slice(start, stop, step)
    if isinstance(value, (str, bytes, list, tuple)):
        _charge(len(range(*where.indices(len(value)))))
    return value[where]


# --- filters, tests and str methods: what each would make, checked first -----------------------

def _guard(original: Any, check: Any, listed: bool = False) -> Any:
    """The filter (or test) ``original`` calling ``check`` with its own arguments (not the environment
    or context jinja passes first to some filters) before it runs, and counting what ``check``
    returns (the characters or items it will make) against :data:`MAX_MADE`. ``listed``: an
    iterator it is given (``map``'s, ``select``'s) is made a list first, so that it can be measured."""
    passed = getattr(original, "jinja_pass_arg", None)
    skip = 1 if passed is not None else 0

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if listed and len(args) > skip and not isinstance(args[skip], (str, bytes, list, tuple, dict)):
            try:
                args = (*args[:skip], list(args[skip]), *args[skip + 1:])
            except TypeError:  # not iterable: the filter says so
                pass
        value = args[skip] if len(args) > skip else None
        made = check(*args[skip:], **kwargs) or 0
        read = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0
        if made >= _SMALL or read >= _SMALL:
            _charge(made, read)
        return original(*args, **kwargs)

    if passed is not None:
        guarded.jinja_pass_arg = passed  # type: ignore[attr-defined]
    return guarded


def _center(s: Any, width: int = 80, *args: Any, **kwargs: Any) -> int:
    n = max(_text_of(s), int(width))
    _check_size(n, "a string")
    return n


def _indent(s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    n = _text_of(s)
    lines = str(s).count("\n") + 1
    n += lines * (len(width) if isinstance(width, str) else int(width))
    _check_size(n, "a string")
    return n


def _wordwrap(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: Any = None,
              *args: Any, **kwargs: Any) -> int:
    _check_size(int(width), "a line")
    n = _text_of(s)
    n += (2 * n // max(1, int(width)) + 1) * (len(str(wrapstring)) if wrapstring is not None else 1)  # the lines
    _check_size(n, "a string")
    return n


def _format(value: Any, *args: Any, **kwargs: Any) -> int:  # jinja's: value % (kwargs or args)
    return _formatted(value, args or (kwargs,), kwargs)


def _replaced(text: Any, old: Any, new: Any, count: Any = None) -> int:
    if not isinstance(text, (str, bytes)):
        _text_of(text)
        text, old, new = str(text), str(old), str(new)
    hits = text.count(old) if old else len(text) + 1
    hits = hits if count is None or count < 0 else min(hits, count)
    n = len(text) + hits * max(0, len(new) - len(old))
    _check_size(n, "a string")
    return n


def _replace(s: Any, old: Any, new: Any, count: int | None = None) -> int:
    return _replaced(s, old, new, count)


def _joined(items: Any, sep: Any) -> int:
    """The length of ``items`` (a list) joined by ``sep``, each item's text measured."""
    n = max(0, len(items) - 1) * _text_of(sep)
    if n > MAX_CHARS:
        _check_size(n, "a string")
    if set(map(type, items)) <= {str}:
        n += sum(map(len, items))
    else:
        for item in items:
            n += _text_of(item)
            if n > MAX_CHARS:
                _check_size(n, "a string", at_least=True)
    _check_size(n, "a string")
    return n


def _join(value: Any, d: Any = "", attribute: Any = None) -> int:
    return _joined(value if isinstance(value, (list, tuple)) else list(value), d)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> int:
    _check_size(int(linecount), "a list")
    n = _sized(value)
    return n + int(linecount) + (n // max(1, int(linecount)) + 1) * _OBJECT


def _slices(value: Any, slices: int, fill_with: Any = None) -> int:
    _check_size(int(slices), "a list")
    return _sized(value) + int(slices) * (1 + _OBJECT)


def _listed(value: Any, *args: Any, **kwargs: Any) -> int:  # list, reverse
    if isinstance(value, str):
        return len(value) * (1 if value.isascii() else 1 + _OBJECT)
    return len(value) if isinstance(value, (bytes, list, tuple, dict)) else 0


def _sorted(value: Any, *args: Any, **kwargs: Any) -> int:  # sort, unique, dictsort, groupby, min, max
    """Sorting, deduplicating or grouping compares (and lowercases) the values: their text measured."""
    n = _measure(value, MAX_CHARS, "compare")[0]
    _check_size(n, "values", verb="compare", at_least=True)
    items = len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0
    _charge(0, n * max(1, items.bit_length()))
    return n + items * (1 + _OBJECT)


def _sum(iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    """``sum`` of lists copies the total so far at each step: quadratic."""
    if not isinstance(start, (list, tuple)) or not isinstance(iterable, (list, tuple)):
        return 0
    total = made = len(start)
    for item in iterable:
        total += _sized(item)
        made += total
    _check_size(total, "a list")
    return made


def _text_filter(factor: int) -> Any:
    """A filter that makes the text of its value (``string``, ``trim``, ``upper``...): at most
    ``factor`` characters a character (``upper`` of ``ß`` is ``SS``; ``urlencode`` writes ``%XX``
    for each UTF-8 byte)."""

    def check(value: Any, *args: Any, **kwargs: Any) -> int:
        n = _text_of(value)
        if factor > 1 and not (type(value) is str and value.isascii()):
            n *= factor
            _check_size(n, "a string")
        return n

    return check


def _escape(value: Any, *args: Any, **kwargs: Any) -> int:
    n = _text_of(value)
    if type(value) is str:
        n += 4 * sum(value.count(c) for c in "&<>\"'")  # &amp; &#34;
    else:
        n *= 5
    _check_size(n, "a string")
    return n


def _reads(*args: Any, **kwargs: Any) -> int:  # makes nothing; reads its value (counted as work by _guard)
    return 0


def _words(value: Any, *args: Any, **kwargs: Any) -> int:  # wordcount: a list of the words, then its length
    n = _text_of(value)
    return n + (n // 2 + 1) * (1 + _OBJECT)


def _pprint(value: Any, *args: Any, **kwargs: Any) -> int:
    size, count, depth = _measure(value, MAX_CHARS)
    _check_size(size, "the text of a value", at_least=True)
    n = size + count * (depth + 1)  # a line and its indentation for each value, at most
    _check_size(n, "the text of a value")
    return n


_FREE_FILTERS = frozenset(["abs", "attr", "count", "d", "default", "filesizeformat", "first", "items", "last", "length",
                           "random", "round", "tojson"])  # O(1), or lazy over what another step made
_COMPARING_TESTS = frozenset(["==", "eq", "equalto", "!=", "ne", "<", "lt", "lessthan", "<=", "le", ">", "gt",
                              "greaterthan", ">=", "ge", "in"])


def _checked_filters(filters: dict[str, Any]) -> dict[str, Any]:
    """Every filter that makes or compares something, checking what it would make first; a filter
    not named here (a later jinja's) is measured as one that makes its value's text."""
    checks: dict[str, Any] = {
        "center": _center, "indent": _indent, "wordwrap": _wordwrap, "format": _format, "replace": _replace,
        "join": _join, "batch": _batch, "slice": _slices, "list": _listed, "reverse": _listed, "sum": _sum,
        "sort": _sorted, "unique": _sorted, "dictsort": _sorted, "groupby": _sorted, "min": _sorted, "max": _sorted,
        "pprint": _pprint, "escape": _escape, "e": _escape, "forceescape": _escape, "xmlattr": _text_filter(6),
        "upper": _text_filter(3), "lower": _text_filter(3), "title": _text_filter(3), "capitalize": _text_filter(3),
        "urlencode": _text_filter(12), "urlize": _text_filter(20), "wordcount": _words,
        **dict.fromkeys(["map", "select", "reject", "selectattr", "rejectattr", "int", "float"], _reads)}
    listed = {"join", "batch", "slice", "list", "sum", "sort", "unique", "dictsort", "groupby", "min", "max"}
    return {name: _guard(original, checks.get(name, _text_filter(1)), listed=name in listed)
            for name, original in filters.items() if name not in _FREE_FILTERS}


def _checked_tests(tests: dict[str, Any]) -> dict[str, Any]:
    """The tests that compare (``eq``, ``in``...), their values measured first."""
    def guard(original: Any) -> Any:
        def guarded(value: Any, other: Any = None) -> bool:
            if not ((type(value) in _SIMPLE or (type(value) is str and len(value) < _SMALL))
                    and (type(other) in _SIMPLE or (type(other) is str and len(other) < _SMALL))):
                _compared(value)
                if original is tests["in"]:
                    _members(other)
                else:
                    _compared(other)
            return original(value, other)

        return guarded

    checked = {name: guard(tests[name]) for name in _COMPARING_TESTS if name in tests}
    checked.update((name, _guard(tests[name], _reads)) for name in ("lower", "upper") if name in tests)  # a scan
    return checked


_SCANS = frozenset(["count", "find", "rfind", "index", "rindex", "startswith", "endswith", "isalnum", "isalpha",
                    "isascii", "isdecimal", "isdigit", "isidentifier", "islower", "isnumeric", "isprintable",
                    "isspace", "istitle", "isupper", "maketrans"])
_COPIES = frozenset(["strip", "lstrip", "rstrip", "removeprefix", "removesuffix"])
_CASES = frozenset(["lower", "upper", "title", "capitalize", "casefold", "swapcase"])


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, key: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(key, default)


def _str_method(s: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, tuple[Any, ...]]:
    """What the ``str`` (or ``bytes``) method ``name`` of ``s`` would make (characters or items), and
    its arguments (``join``'s iterator made a list, to be measured)."""
    n = len(s)
    if name in _SCANS:
        _charge(0, n + sum(_sized(a) for a in args))
        return 0, args
    if name in _COPIES:
        return n, args
    if name in _CASES:
        made = n if s.isascii() else 3 * n
    elif name in ("center", "ljust", "rjust", "zfill"):
        made = max(n, int(_arg(args, kwargs, 0, "width", 0)))
    elif name == "expandtabs":
        made = n + s.count("\t" if isinstance(s, str) else b"\t") * max(0, int(_arg(args, kwargs, 0, "tabsize", 8)))
    elif name == "replace":
        made = _replaced(s, _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", ""),
                         _arg(args, kwargs, 2, "count", -1))
    elif name == "join":
        items = _arg(args, kwargs, 0, "iterable", ())
        if not isinstance(items, (list, tuple)):
            items = list(items)
            args = (items, *args[1:])
        made = _joined(items, s)
    elif name in ("format", "format_map"):
        mapping = args[0] if name == "format_map" and args else kwargs
        made = _formatted(s, args if name == "format" else (), mapping, braces=True)
    elif name in ("split", "rsplit", "splitlines"):
        lines = name == "splitlines"
        sep = None if lines else _arg(args, kwargs, 0, "sep", None)
        if sep:
            pieces = s.count(sep) + 1
        elif lines and isinstance(s, str) and s.replace("\n", "").replace("\r", "").isprintable():
            pieces = s.count("\n") + s.count("\r") + 1
        elif not lines and isinstance(s, str) and s.isascii():  # runs of whitespace
            pieces = min(n // 2, sum(s.count(c) for c in " \t\n\r\x0b\x0c")) + 1
        else:
            pieces = n + 1 if lines else n // 2 + 1
        maxsplit = -1 if lines else _arg(args, kwargs, 1, "maxsplit", -1)
        if isinstance(maxsplit, int) and maxsplit >= 0:
            pieces = min(pieces, maxsplit + 1)
        _check_size(n, "a string")
        _check_size(pieces, "a list")
        return n + pieces * (1 + _OBJECT), args
    elif name in ("partition", "rpartition"):
        return n + 3 * _OBJECT, args
    elif name == "translate":
        table = _arg(args, kwargs, 0, "table", None)
        widest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1) \
            if isinstance(table, dict) else 1
        made = n * max(1, widest)
    elif name == "encode":
        made = 4 * n
    else:  # a method of a later Python: as if it made a copy
        made = n
    _check_size(made, "a string")
    return made, args


def _budgeted(ast: Any) -> Any:
    """The parsed template with every loop's iterable counted (:func:`_counted`, with the literal text
    of its body), every ``~`` concatenation checked (:func:`_concat`), every slice's length counted
    (:func:`_slice`), and the values that a comparison or a dict key walks measured
    (:func:`_compared`): the right side of a comparison (it reads no more than the smaller side)
    unless either is a constant (``role == 'user'``), both sides of ``in`` (the left one is hashed,
    or compared with the right one's items), a subscript or dict key that is not a constant."""
    return _budget_transformer()().visit(ast)


def _filter_call(name: str, args: list[Any], lineno: int) -> Any:
    """A call of the filter ``name`` on ``args``: called directly, not through the sandbox."""
    from jinja2 import nodes

    return nodes.Filter(args[0], name, args[1:], [], None, None, lineno=lineno)


def _constant_node(node: Any) -> bool:
    """Whether a node is a constant: ``'user'``, ``-1``, ``['user', 'system']``."""
    from jinja2 import nodes

    return (isinstance(node, nodes.Const) or (isinstance(node, (nodes.Neg, nodes.Pos)) and _constant_node(node.node))
            or (isinstance(node, (nodes.List, nodes.Tuple)) and all(_constant_node(item) for item in node.items)))


def _measured_node(node: Any) -> Any:
    """A node whose value a comparison or a hash reads, measured first (a constant as it is)."""
    return node if _constant_node(node) else _filter_call("_genkit_compared", [node], node.lineno)


def _node_text(node: Any) -> int:
    """The template text a node writes, less nested loops' and macros'."""
    from jinja2 import nodes

    if isinstance(node, nodes.TemplateData):
        return len(node.data)
    if isinstance(node, (nodes.For, nodes.Macro)):
        return 0
    return sum(_node_text(child) for child in node.iter_child_nodes())


@functools.lru_cache(maxsize=1)
def _budget_transformer() -> Any:
    """The node transformer :func:`_budgeted` runs (a class made once: jinja2 is imported on first use)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    class Budget(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            text = sum(_node_text(child) for child in node.body)
            node = self.generic_visit(node)
            node.iter = _filter_call("_genkit_counted", [node.iter, nodes.Const(text, lineno=node.lineno)],
                                     node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return _filter_call("_genkit_concat", list(node.nodes), node.lineno)

        def visit_Getitem(self, node: Any) -> Any:
            node = self.generic_visit(node)
            if not isinstance(node.arg, nodes.Slice):
                node.arg = _measured_node(node.arg)  # a tuple key is hashed
                return node
            bounds = [getattr(node.arg, k) or nodes.Const(None, lineno=node.lineno) for k in ("start", "stop", "step")]
            return _filter_call("_genkit_slice", [node.node, *bounds], node.lineno)

        def visit_Compare(self, node: Any) -> Any:
            node = self.generic_visit(node)
            operands = [node.expr] + [op.expr for op in node.ops]
            for i, op in enumerate(node.ops):
                left, right = operands[i], operands[i + 1]
                if op.op in ("in", "notin"):
                    if not _constant_node(right):
                        op.expr = _filter_call("_genkit_members", [right], right.lineno)
                    if i == 0:
                        node.expr = _measured_node(left)
                elif not _constant_node(left) and not _constant_node(right):  # reads no more than the smaller side
                    op.expr = _measured_node(right)
            return node

        def visit_Dict(self, node: Any) -> Any:
            node = self.generic_visit(node)
            for pair in node.items:
                pair.key = _measured_node(pair.key)
            return node

    return Budget


def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
           separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter as transformers defines it (``json.dumps``, not jinja's HTML-escaping
    one), the text it would write (indentation and separators included) measured against
    :data:`MAX_CHARS` first."""
    width = len(indent) if isinstance(indent, str) else int(indent or 0)
    seps = sum(len(str(x)) for x in separators) if isinstance(separators, (list, tuple)) else 0
    size, count, depth = _measure(value, MAX_CHARS, "json_ascii" if ensure_ascii else "json")
    _check_size(size, "a JSON text", at_least=True)
    if width or seps:
        spacing = count * (width * depth + seps + 1)
        _check_size(spacing, "a JSON text")
        size += spacing
        _check_size(size, "a JSON text")
    _charge(size)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:  # noqa: A002 (transformers' name)
    """The current local time, formatted (transformers' ``strftime_now``: Llama 3.x's date)."""
    for width in re.findall(r"%[-_0^#]*(\d+)", str(format)):
        _check_size(int(width), "a formatted field")
    n = len(str(format)) + sum(int(w) for w in re.findall(r"%[-_0^#]*(\d+)", str(format))) + 64 * str(format).count("%")
    _check_size(n, "a string")  # %c writes 24 characters, a locale's names more
    _charge(n)
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
            account = _account.get(None)
            if account is not None:
                account.spans.append((account.rendered, account.rendered + len(text)))
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
            _charge(sum(len(a) for a in rest if isinstance(a, dict)) + len(kwargs))
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type's other attributes (transformers'),
    the keys they hash measured first."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        _charge(sum(_sized(_compared(a)) for a in args) + len(kwargs))
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        _charge(sum(_sized(_compared(a)) for a in args))
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Budgeted(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, at once
                n = len(left) + len(right)
                if n >= _SMALL:
                    if n > MAX_CHARS:
                        _check_size(n, "a string or list")
                    _charge(n)
                return left + right
            _charge(_binop(operator, left, right))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's names)
            inner = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(inner, "__self__", None)
            name = getattr(inner, "__name__", "")
            if isinstance(owner, (str, bytes)):
                made, args = _str_method(owner, name, args, kwargs)
                _charge(made)
                return super().call(__context, __obj, *args, **kwargs)
            if isinstance(owner, (list, tuple, dict)):  # count, index, get, items, copy, fromkeys...
                for a in args:  # compared with the items, or hashed
                    _compared(a)
                if name in ("count", "index"):
                    _compared(owner)
                _charge(len(owner) if name == "copy" else _sized(args[0]) if name == "fromkeys" and args else 0)
                return super().call(__context, __obj, *args, **kwargs)
            if isinstance(owner, LoopContext) and name == "changed":
                for a in args:
                    _compared(a)
            elif isinstance(__obj, LoopContext) and args:  # loop(children) in a recursive for: its iterations count
                args = (_counted(args[0]), *args[1:])
            result = super().call(__context, __obj, *args, **kwargs)
            # a macro's, caller()'s or loop()'s text, made of its body; a call is work like an iteration
            _charge(len(result) if isinstance(result, str) else 0, _LOOP_WORK)
            return result

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                   extensions=[_generation_extension(), "jinja2.ext.loopcontrols"])
    env.filters.update(_checked_filters(env.filters))
    env.filters["tojson"] = tojson
    env.tests.update(_checked_tests(env.tests))
    env.filters.update(_genkit_counted=_counted, _genkit_concat=_concat, _genkit_slice=_slice,
                       _genkit_compared=_compared, _genkit_members=_members)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=_TemplateDict(),
                       namespace=_namespace())
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
