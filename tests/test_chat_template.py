"""A model's chat template is hostile input (it comes with the model's files): rendered in jinja2's
immutable sandbox with budgets on loops, sizes and recursion (genkit/chat_template.py), each refused
before the work is done with a ConfigError naming the budget; real templates render as before."""

from __future__ import annotations

import time

import pytest

from genkit import chat_template
from genkit.errors import ConfigError

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
DOUBLING = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
BUDGET = r"the budget is 16777216 \(genkit.chat_template.MAX_CHARS\)"

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
