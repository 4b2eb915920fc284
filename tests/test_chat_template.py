"""A model's chat template is hostile input (it comes with the model's files): rendered in jinja2's
immutable sandbox with budgets on loops, sizes and recursion (genkit/chat_template.py), each refused
before the work is done with a ConfigError naming the budget; real templates render as before.
Beside the per-operation budgets, each render has totals: what all its operations make together
(MAX_MADE), the text of any one value printed or serialized (measured before str() or json),
CPU time (MAX_SECONDS); a MemoryError is a ConfigError too."""

from __future__ import annotations

import time

import pytest

from genkit import chat_template
from genkit.errors import ConfigError

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
BUDGET = r"the budget is 16777216 \(genkit.chat_template.MAX_CHARS\)"
MADE = r"the chat template is too costly: it would make \d+ characters or items in one render; the budget is "
# a list of 6 references to a list of 1000 references to one list of 1000 zeros: 6M items held by
# three small lists; its text, or its JSON, is 18 MB, built before anything looked at its size
NESTED = "{% set a = [0] * 1000 %}{% set b = [a] * 1000 %}{% set c = [b] * 6 %}"
TEXT = r"the chat template is too costly: it would make {} of at least \d+ characters or items; " + BUDGET

HOSTILE = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     r"more than 1000000 loop iterations \(genkit.chat_template.MAX_LOOPS\)"),
    ("{{ 'x' * 10000000000 }}", "a string or list of 10000000000 characters or items; " + BUDGET),
    ("{{ [0] * 100000000 }}", "a string or list of 100000000 characters"),
    ("{{ 10 ** 100000000 }}", r"raises to the power 100000000; the budget is 4096"),
    (DOUBLING.replace("OP", "~"), "a string of 33554432 characters"),
    (DOUBLING.replace("OP", "+"), "a string or list of 33554432 characters"),
    ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
     "a string of 33554432 characters"),
    ("{{ 'a'|center(10000000000) }}", "a string of 10000000000 characters"),
    ("{{ 'a\nb'|indent(10000000000) }}", "a string of 20000000003 characters"),
    ("{{ 'a b'|wordwrap(10000000000) }}", "a line of 10000000000 characters"),
    ("{{ '%999999999999s'|format('a') }}", "a formatted field of 999999999999 characters"),
    ("{{ '%100000000s' % 'a' }}", "a formatted field of 100000000 characters"),
    ("{{ '{:>100000000}'.format('a') }}", "a formatted field of 100000000 characters"),
    ("{{ range(100000)|list|join('x' * 1000) }}", "a string of 99999000 characters"),
    ("{{ [1]|batch(1000000000, 'x')|list }}", "a list of 1000000000 characters or items"),
    ("{{ [1]|slice(1000000000)|list }}", "a list of 1000000000 characters or items"),
    ("{% for i in range(10**9) %}{% endfor %}", "asks for too much: Range too big"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses without end"),
    ("{{ lipsum(1000000000) }}", "'lipsum' is undefined"),
    ("{% for i in range(3000) %}{{ 'x' * 10000 }}{% endfor %}", "the rendered text of 16780000 characters"),
    # a value's text is measured (a bounded walk of its containers) before str() or json.dumps makes it
    (NESTED + "{{ c }}", TEXT.format("the text of a value")),
    (NESTED + "{% set x %}{{ c }}{% endset %}{{ x|length }}", TEXT.format("the text of a value")),
    (NESTED + "{{ c|tojson|length }}", TEXT.format("a JSON text")),
    (NESTED + "{{ c|string|length }}", TEXT.format("the text of a value")),
    (NESTED + "{{ c|pprint|length }}", TEXT.format("the text of a value")),
    (NESTED + "{{ ('' ~ c)|length }}", TEXT.format("the text of a value")),
    (NESTED + "{{ [c]|join|length }}", TEXT.format("the text of a value")),
    (NESTED + "{{ '%s'|format(c)|length }}", TEXT.format("the text of a value")),
    ("{{ (['x' * 100000] * 1000)|join|length }}", "a string of 100000000 characters"),
    # str methods make strings as the filters do
    ("{{ 'x'.center(100000000)|length }}", "a string of 100000000 characters"),
    ("{{ (('a' * 1000).replace('a', 'b' * 100000))|length }}", "a string of 100000000 characters"),
    ("{{ ('x' * 100000).join(['a'] * 1000)|length }}", "a string of 99900000 characters"),
    # each iteration makes a 16M-character string (within MAX_CHARS): the render's total stops it
    ("{% for i in range(100) %}{% if ('x' * 16000000).count('y') %}{% endif %}{% endfor %}ok",
     MADE + r"67108864 \(genkit.chat_template.MAX_MADE\)"),
    # integers that double their digits each step
    ("{% set ns = namespace(n=3) %}{% for i in range(22) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     r"an integer of \d+ bits; the budget is 65536 \(genkit.chat_template.MAX_INT_BITS\)"),
    ("{{ ((10 ** 1000) ** 1000) > 0 }}", r"an integer of 3322000 bits"),
    # a format names an argument many times, or takes a width from its arguments
    ("{{ ('{0}' * 10000).format('x' * 16000)|length }}", "a string of 16782000 characters"),
    ("{{ '{:{}}'.format('a', 100000000)|length }}", "a string of 100000006 characters"),
    ("{{ ('%*s' % (100000000, 'a'))|length }}", "a string of 100000014 characters"),
    ("{{ (('%(a)s' * 10000) % {'a': 'x' * 16000})|length }}", "a string of 160050000 characters"),
    ("{{ strftime_now('%c' * 8000000)|length }}", "a string of 528000000 characters"),
    # many new objects, or quadratic copies, from one filter
    ("{{ [1]|slice(16000000)|list|length }}", MADE + r"67108864 \(genkit.chat_template.MAX_MADE\)"),
    ("{% set a = [0] * 4000 %}{{ ([a] * 4000)|sum(start=[])|length }}", MADE + "67108864"),
]


@pytest.mark.parametrize(("template", "message"), HOSTILE, ids=[t[:40] for t, _ in HOSTILE])
def test_a_hostile_template_stops_at_its_budget(template, message):
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        chat_template.render(template, messages=MESSAGES)
    assert time.perf_counter() - start < 10  # stopped by the budget, not by running to the end


def test_templates_within_the_budgets_render_as_jinja_renders_them():
    import jinja2.sandbox

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] ~ '!' }}\n{% endfor %}"
                "{{ ['a', 'b']|join(', ') }}|{{ 'x'|center(5) }}|{{ 'a b'|replace('a', 'c') }}|"
                "{{ [1, 2, 3]|batch(2)|list }}|{{ '%5s'|format('z') }}|{{ '{:>4}'.format(7) }}|{{ 'ab' * 3 }}|"
                "{{ 2 ** 10 }}|{{ 'a\nb'|indent(2) }}|{% for i in range(3) %}{{ loop.index }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(template).render(messages=MESSAGES, add_generation_prompt=True)
    assert chat_template.render(template, messages=MESSAGES, add_generation_prompt=True) == want
    assert "<|user|>hi!" in want and want.endswith("123<|assistant|>")


def test_the_loop_budget_counts_one_render_at_a_time():
    template = "{% for i in range(1000) %}{% for j in range(600) %}{% endfor %}{% endfor %}ok"  # 601000 a render
    assert chat_template.render(template) == "ok"
    assert chat_template.render(template) == "ok"


def test_lists_accumulated_in_a_namespace_stop_at_the_render_budget(monkeypatch):
    """each `[0] * n` and each `+` passes its own check; what they make together is counted (the
    audit's case made a 16M-item list per iteration: 12.8 GB in 100 iterations)"""
    monkeypatch.setattr(chat_template, "MAX_MADE", 4_000_000, raising=False)
    template = ("{% set ns = namespace(l=[]) %}{% for i in range(12) %}{% set ns.l = ns.l + [[0] * 1000000] %}"
                "{% endfor %}{{ ns.l|length }}")
    with pytest.raises(ConfigError, match=MADE + r"4000000 \(genkit.chat_template.MAX_MADE\)"):
        chat_template.render(template)


def test_the_made_budget_counts_one_render_at_a_time(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_MADE", 3_000_000, raising=False)
    template = "{% for i in range(2) %}{% set x = [0] * 1000000 %}{% endfor %}ok"  # 2,000,000 a render
    assert chat_template.render(template) == "ok"
    assert chat_template.render(template) == "ok"


@pytest.mark.parametrize("template", [
    "{% set big = [0] * 1000000 %}{% set ns = namespace(l=[]) %}{% for i in range(12) %}"
    "{% set ns.l = ns.l + [big[1:]] %}{% endfor %}",  # slices copy
    "{% macro m() %}" + "y" * 100000 + "{% endmacro %}{% for i in range(100) %}{% set x = m() %}{% endfor %}",
    "{% for i in range(100) %}{% set x %}" + "y" * 100000 + "{% endset %}{% endfor %}",  # a loop's own text
    "{{ ('日' * 1000000)|list|length }}",  # a million new one-character strings
])
def test_what_else_a_render_makes_counts_in_its_total(monkeypatch, template):
    monkeypatch.setattr(chat_template, "MAX_MADE", 4_000_000, raising=False)
    with pytest.raises(ConfigError, match=MADE + r"4000000 \(genkit.chat_template.MAX_MADE\)"):
        chat_template.render(template)


def test_values_compared_or_hashed_are_measured_first(monkeypatch):
    """a tuple of two references to a tuple of two references...: 64 doublings are 64 small tuples
    whose hash, comparison or text visits 2**64 values"""
    monkeypatch.setattr(chat_template, "MAX_CHARS", 100_000)
    doubled = "{% set ns = namespace(t=(1,)) %}{% for i in range(64) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}"
    for use in ("{% set d = {ns.t: 1} %}", "{{ {}.get(ns.t) }}", "{{ ns.t in {} }}", "{{ ns.t == (ns.t, 1) }}",
                "{{ [ns.t]|unique|list }}", "{{ ns.t is eq(ns.t) }}"):
        with pytest.raises(ConfigError, match=r"it would compare values of at least \d+ characters or items; the "
                                              r"budget is 100000 \(genkit.chat_template.MAX_CHARS\)"):
            chat_template.render(doubled + use)


def test_a_recursive_loop_counts_its_iterations(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_LOOPS", 1000)
    with pytest.raises(ConfigError, match=r"ran more than 1000 loop iterations \(genkit.chat_template.MAX_LOOPS\)"):
        chat_template.render("{% for x in [30] recursive %}{% if x %}{{ loop([x - 1, x - 1]) }}{% endif %}{% endfor %}")


def test_work_that_makes_nothing_stops_at_the_cpu_budget(monkeypatch):
    """a scan of a 4M-character string per iteration makes nothing and each loop is within
    MAX_LOOPS: the render's CPU time stops it"""
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.2, raising=False)
    template = "{% set s = 'x' * 4000000 %}{% for i in range(3000) %}{% if s.count('y') %}{% endif %}{% endfor %}ok"
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"the chat template is too costly: it ran for more than 0.2 CPU seconds; "
                                          r"the budget is 0.2 \(genkit.chat_template.MAX_SECONDS\)"):
        chat_template.render(template)
    assert time.perf_counter() - start < 5
    # macros calling each other make nothing and loop nowhere: 2**40 calls
    with pytest.raises(ConfigError, match=r"ran for more than 0.2 CPU seconds"):
        chat_template.render("{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(40) }}")


def test_running_out_of_memory_is_a_config_error(monkeypatch):
    """with the size budgets lifted, a string no machine can hold: MemoryError escaped the render"""
    monkeypatch.setattr(chat_template, "MAX_CHARS", 10**19)
    monkeypatch.setattr(chat_template, "MAX_MADE", 10**19, raising=False)
    with pytest.raises(ConfigError, match=r"the chat template is too costly: it ran out of memory \(MemoryError\)"):
        chat_template.render("{{ 'x' * 10**18 }}")
