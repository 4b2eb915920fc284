"""Two versions of ``genkit/chat_template.py`` timed against each other in one process, on the real
chat templates of ``tests/fixtures/chat_templates``.

The other version is loaded from a file (as ``gkbase.chat_template``, beside this checkout's
``genkit.chat_template``); both render the same jobs: every corpus template with the conversations of
``tests/test_chat_template_corpus.py`` (system + user, tools, documents...) in its three modes (720
renders), then a long conversation (400 messages, about 0.9 MB) through every template. The two
must give the same text, spans and errors; each round times both (their order alternating), in CPU
time of this thread (``time.thread_time``: on a shared machine, wall time moves 20-30 % from one
minute to the next), every template compiled once beforehand; the minimum and median over the
rounds are printed, and the compile time of the 24 templates.

Run: ``git show main:genkit/chat_template.py > /tmp/chat_template_main.py; python
bench/ab_chat_template.py /tmp/chat_template_main.py --rounds 30``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def load_other(path: str) -> Any:
    import genkit.errors

    package = types.ModuleType("gkbase")
    package.__path__ = []
    sys.modules["gkbase"] = package
    sys.modules["gkbase.errors"] = genkit.errors
    spec = importlib.util.spec_from_file_location("gkbase.chat_template", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gkbase.chat_template"] = module
    spec.loader.exec_module(module)
    return module


def jobs() -> tuple[list[Any], list[Any], list[str]]:
    sys.path.insert(0, str(ROOT / "tests"))
    import test_chat_template_corpus as corpus

    short = [(template, messages, {**kwargs, **mode, **SPECIAL})
             for _, template in sorted(corpus.TEMPLATES.items())
             for messages, kwargs in corpus.CONVERSATIONS.values()
             if not any(callable(t) for t in kwargs.get("tools") or [])  # Python-function tools need transformers
             for mode in corpus.MODES]
    para = ("The quick brown fox jumps over the lazy dog. " * 10 + "\n") * 5
    conversation = [{"role": "system", "content": "Be brief."}]
    conversation += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {para}"} for i in range(400)]
    conversation.append({"role": "user", "content": "last"})
    long = [(template, conversation, {"add_generation_prompt": True, **SPECIAL})
            for _, template in sorted(corpus.TEMPLATES.items())]
    return short, long, list(corpus.TEMPLATES.values())


def run(module: Any, work: list[Any]) -> list[Any]:
    out = []
    for template, messages, kwargs in work:
        try:
            out.append(module.render_conversation(template, messages, **kwargs))
        except Exception as exc:  # noqa: BLE001 - compared between the versions
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", help="the other version of genkit/chat_template.py")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    from genkit import chat_template

    versions = {"other": load_other(args.other), "this": chat_template}
    for module in versions.values():  # every template stays compiled: render time only
        module._compile = functools.lru_cache(maxsize=64)(module._compile.__wrapped__)
    short, long, templates = jobs()
    for label, work in (("corpus", short), ("long conversation", long)):
        if run(versions["other"], work) != run(versions["this"], work):
            raise SystemExit(f"{label}: the two versions render differently")
        times: dict[str, list[float]] = {name: [] for name in versions}
        for r in range(args.rounds):
            for name in (list(versions) if r % 2 else list(reversed(versions))):
                start = time.thread_time()
                run(versions[name], work)
                times[name].append(time.thread_time() - start)
        other, this = times["other"], times["this"]
        print(f"{label} ({len(work)} renders, the same output): other min {min(other) * 1e3:.1f} ms median "
              f"{statistics.median(other) * 1e3:.1f} | this min {min(this) * 1e3:.1f} ms median "
              f"{statistics.median(this) * 1e3:.1f} | this/other min {min(this) / min(other):.3f} median "
              f"{statistics.median(this) / statistics.median(other):.3f}")
    for name, module in versions.items():
        best = float("inf")
        for _ in range(5):
            module._compile.cache_clear()
            start = time.thread_time()
            for template in templates:
                module._compile(template)
            best = min(best, time.thread_time() - start)
        print(f"compile {len(templates)} templates, {name}: best {best * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
