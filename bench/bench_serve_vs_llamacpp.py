"""``genkit serve`` against llama.cpp's ``llama-server`` on the same GGUF, with the same OpenAI
streaming client, at 1, 8 and 32 concurrent clients.

Both servers run in subprocesses on 127.0.0.1 with the same number of threads: genkit with the file
kept quantized (the block kernel; continuous batching), llama.cpp with ``--parallel`` slots (its
continuous batching) and the same context per slot. Each client is a thread that sends
``--requests-per-client`` streaming completions (greedy, ``--new-tokens`` each) one after the other;
time to first token is from sending a request to its first text chunk, throughput is the completion
tokens of all requests over the round's wall time. Rounds alternate between the two servers and
repeat ``--repeats`` times; the tables give medians. The clients cycle through four prompts, so
both servers find a repeated prompt in their prompt cache (genkit's: docs/continuous_batching.md;
llama-server's: each slot keeps its last prompt); ``--fresh-prompts`` starts every timed prompt
with a new number, so that each request computes its whole prompt. Before timing, each server answers the same
prompts greedily (non-streaming) and the completions are compared token by token (each text
encoded with the GGUF's tokenizer): exact-equal completions are counted, and for the others the first
differing token is named.

``--activation-digits 1,2`` serves genkit once per setting (``genkit serve --activation-digits N``:
1 is llama.cpp's activation rounding, 2 the default), all in the same alternating rounds.
``--numerics llama.cpp`` serves genkit once more with ``genkit serve --numerics llama.cpp`` (llama.cpp's
float operations op for op, in the order of llama.cpp built for this CPU: its completions should be a
native llama-server's, token for token); ``--numerics llama.cpp-avx2`` for a llama-server built with
AVX2 only on an AVX-512 CPU.
``--llama-flags`` passes more flags to llama-server, e.g. ``"-ctk f32 -ctv f32 -fa off"`` (a float32
KV cache and no flash attention: the float path closest to genkit's).

llama.cpp is never a genkit dependency: build it in a bench-only folder, e.g. from the source that
llama-cpp-python's sdist vendors (``pip download --no-deps --no-binary :all: llama-cpp-python``)::

    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DGGML_AMX=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build build -j2 --target llama-server llama-bench

(``-DGGML_AMX=OFF``: llama.cpp's AMX kernel crashes on some Xeons.) A newer llama.cpp source folder
builds the same way; add ``-DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF`` (its web UI and HTTPS: neither is
measured, and the UI's prebuilt files are downloaded at configure time).

Run: ``python bench/bench_serve_vs_llamacpp.py --llama-server build/bin/llama-server --threads 2``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import PROMPTS, _free_port, _wait, round_  # noqa: E402  (the same client as bench_serve.py)

from genkit.models.cpu import describe
from genkit.models.numerics import NUMERICS  # noqa: E402

BASELINE = "genkit baseline"  # --baseline-python: another genkit (e.g. main's venv) in the same rounds


LLAMA_NUMERICS = "genkit (llama.cpp numerics)"  # genkit serve --numerics <--numerics>


def _genkit_name(digits: int) -> str:
    return f"genkit ({digits} digit{'s' if digits > 1 else ''})"


def _genkit_flags(name: str, args: argparse.Namespace) -> list[str]:
    if name == BASELINE:
        return []
    if name == LLAMA_NUMERICS:
        return ["--numerics", args.numerics]
    return ["--activation-digits", name.split("(")[1].split()[0]]


def _start(name: str, gguf: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cwd = None
    if name.startswith("genkit"):
        python = args.baseline_python if name == BASELINE else sys.executable
        cmd = [python, "-m", "genkit", "serve", "--model", gguf, "--model-name", "m", "--port", str(port)]
        cmd += _genkit_flags(name, args)
        cwd = "/"  # the installed genkit (the baseline's own), not the source tree of this folder
    else:
        slots = max(args.clients)
        cmd = [args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(args.threads),
               "-tb", str(args.threads), "--parallel", str(slots), "-c", str(slots * args.context), "--no-webui",
               *args.llama_flags.split()]
    log = tempfile.TemporaryFile("w+")  # the server's output, named if it exits before answering
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    _wait(base, proc, log)
    return proc, base


def _texts(client: Any, new: int) -> list[str]:
    return [client.completions.create(model="m", prompt=p, max_tokens=new, temperature=0).choices[0].text
            for p in PROMPTS]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), or None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _compare(texts: dict[str, list[str]], gguf: str) -> None:
    """Per prompt, each genkit server's completion against llama-server's, token by token."""
    import genkit

    tok = genkit.load_tokenizer(gguf)
    ours = [n for n in texts if n != "llama.cpp"]
    print("| prompt | " + " | ".join(f"{n} vs llama.cpp" for n in ours) + " |\n|---|" + "---|" * len(ours))
    equal = dict.fromkeys(ours, 0)
    for i, p in enumerate(PROMPTS):
        ref = tok(texts["llama.cpp"][i])["input_ids"]
        cells = []
        for n in ours:
            at = first_difference(tok(texts[n][i])["input_ids"], ref)
            equal[n] += at is None
            cells.append("identical" if at is None else f"differ from token {at}")
        print(f"| {p!r} | " + " | ".join(cells) + " |")
    print("\nexact-equal completions: " + ", ".join(f"{n} {equal[n]}/{len(PROMPTS)}" for n in ours) + "\n")


def _report(results: dict[str, dict[int, list[tuple[list[float], float, int]]]], clients: list[int]) -> None:
    print("| clients | server | tokens/s (median) | TTFT p50 s | TTFT p99 s | tokens/s / llama.cpp's | "
          "TTFT p50 / llama.cpp's |\n|---|---|---|---|---|---|---|")
    for n in clients:
        rates, p50s, p99s = {}, {}, {}
        for name in results:
            rounds = results[name][n]
            rates[name] = statistics.median(tokens / wall for _, wall, tokens in rounds)
            ttfts = sorted(t for r in rounds for t in r[0])
            p50s[name] = statistics.median(ttfts)
            p99s[name] = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
        for name in results:
            ratios = ("", "") if name == "llama.cpp" else (f"{rates[name] / rates['llama.cpp']:.2f}x",
                                                             f"{p50s[name] / p50s['llama.cpp']:.2f}x")
            print(f"| {n} | {name} | {rates[name]:.1f} | {p50s[name]:.3f} | {p99s[name]:.3f} | {ratios[0]} | "
                  f"{ratios[1]} |", flush=True)


def main() -> None:
    import openai

    from genkit.models.demo import demo_gguf_path, genkit_home

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", required=True, help="path of llama.cpp's llama-server binary")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the demo SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="llama-server context per slot")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--activation-digits", default="2",
                        help="genkit's activation digits to serve, comma-separated (1,2: both, in the same rounds)")
    parser.add_argument("--numerics", default="", help="'llama.cpp' (or a build's: 'llama.cpp-avx2', ...): serve "
                        "genkit with that --numerics too (llama.cpp's float operations op for op), in the same rounds")
    parser.add_argument("--llama-flags", default="", help="more llama-server flags, e.g. '-ctk f32 -ctv f32 -fa off'")
    parser.add_argument("--fresh-prompts", action="store_true",
                        help="start every timed prompt with a new number: no prompt cache (genkit's or llama-server's "
                        "per-slot one) can hold it, so each request computes its whole prompt")
    parser.add_argument("--compare-tokens", type=int, default=64, help="greedy tokens per compared completion")
    parser.add_argument("--baseline-python", default=None,
                        help="a Python whose genkit is served too, in the same alternating rounds (before/after)")
    args = parser.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    args.clients = [int(c) for c in args.clients.split(",")]
    gguf = args.gguf or demo_gguf_path(f"{genkit_home()}/bench-gguf")
    ours = [_genkit_name(int(d)) for d in args.activation_digits.split(",") if d]
    if args.numerics and args.numerics not in NUMERICS[1:]:
        parser.error(f"--numerics must be one of {', '.join(NUMERICS[1:])} (or left out); got {args.numerics!r}")
    ours += [LLAMA_NUMERICS] if args.numerics else []
    names = (*ours, BASELINE, "llama.cpp") if args.baseline_python else (*ours, "llama.cpp")
    servers = {name: _start(name, gguf, args) for name in names}
    try:
        clients = {name: openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for name, (_, base) in servers.items()}
        texts = {name: _texts(c, args.compare_tokens) for name, c in clients.items()}
        print(f"{os.path.basename(gguf)}, {args.threads} threads each, streaming completions, greedy, "
              f"{args.new_tokens} new tokens, {args.requests_per_client} requests per client, "
              f"median of {args.repeats} alternating rounds; llama-server flags: {args.llama_flags or '(defaults)'}\n")
        print(f"Greedy completions of {args.compare_tokens} tokens:\n")
        _compare(texts, gguf)
        results: dict[str, dict[int, list[Any]]] = {name: {n: [] for n in args.clients} for name in clients}
        for client in clients.values():
            round_(client, 1, 1, 8)  # warm-up
        for _ in range(args.repeats):
            for n in args.clients:
                for name, client in clients.items():
                    load = os.getloadavg()[0]
                    results[name][n].append(round_(client, n, args.requests_per_client, args.new_tokens,
                                                          args.fresh_prompts))
                    ttfts, wall, tokens = results[name][n][-1]
                    print(f"round: {n} clients, {name}: {tokens / wall:.1f} tokens/s, TTFT p50 "
                          f"{statistics.median(ttfts):.3f} s, load average {load:.1f} -> {os.getloadavg()[0]:.1f}",
                          flush=True)
        _report(results, args.clients)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
