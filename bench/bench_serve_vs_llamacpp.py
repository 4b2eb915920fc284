"""``genkit serve`` against llama.cpp's ``llama-server`` on the same GGUF, with the same OpenAI
streaming client, at 1, 8 and 32 concurrent clients.

Both servers run in subprocesses on 127.0.0.1 with the same number of threads: genkit with the file
kept quantized (the block kernel; continuous batching), llama.cpp with ``--parallel`` slots (its
continuous batching) and the same context per slot. Each client is a thread that sends
``--requests-per-client`` streaming completions (greedy, ``--new-tokens`` each) one after the other;
time to first token is from sending a request to its first text chunk, throughput is the completion
tokens of all requests over the round's wall time. Rounds alternate between the two servers and
repeat ``--repeats`` times; the tables give medians. Before timing, each server answers the same
prompts greedily (non-streaming) and the texts are compared.

llama.cpp is never a genkit dependency: build it in a bench-only folder, e.g. from the source that
llama-cpp-python's sdist vendors (``pip download --no-deps --no-binary :all: llama-cpp-python``)::

    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DGGML_AMX=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build build -j2 --target llama-server llama-bench

(``-DGGML_AMX=OFF``: llama.cpp's AMX kernel crashes on some Xeons.)

Run: ``python bench/bench_serve_vs_llamacpp.py --llama-server build/bin/llama-server --threads 2``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import PROMPTS, _free_port, _wait, round_  # noqa: E402  (the same client as bench_serve.py)

BASELINE = "genkit baseline"  # --baseline-python: another genkit (e.g. main's venv) in the same rounds


def _start(name: str, gguf: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cwd = None
    if name.startswith("genkit"):
        python = args.baseline_python if name == BASELINE else sys.executable
        cmd = [python, "-m", "genkit", "serve", "--model", gguf, "--model-name", "m", "--port", str(port)]
        cwd = "/" if name == BASELINE else None  # its own genkit, not the one of this folder
    else:
        slots = max(args.clients)
        cmd = [args.llama_server, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-t", str(args.threads),
               "-tb", str(args.threads), "--parallel", str(slots), "-c", str(slots * args.context), "--no-webui"]
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    _wait(base, proc)
    return proc, base


def _texts(client: Any, new: int) -> list[str]:
    return [client.completions.create(model="m", prompt=p, max_tokens=new, temperature=0).choices[0].text
            for p in PROMPTS]


def _same_prefix(a: str, b: str) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return "identical" if a == b else f"first {n} characters ({len(a[:n].split())} words)"


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
    parser.add_argument("--baseline-python", default=None,
                        help="a Python whose genkit is served too, in the same alternating rounds (before/after)")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    gguf = args.gguf or demo_gguf_path(f"{genkit_home()}/bench-gguf")
    names = ("genkit", BASELINE, "llama.cpp") if args.baseline_python else ("genkit", "llama.cpp")
    servers = {name: _start(name, gguf, args) for name in names}
    try:
        clients = {name: openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
                   for name, (_, base) in servers.items()}
        texts = {name: _texts(c, 32) for name, c in clients.items()}
        print(f"{os.path.basename(gguf)}, {args.threads} threads each, streaming completions, greedy, "
              f"{args.new_tokens} new tokens, {args.requests_per_client} requests per client, "
              f"median of {args.repeats} alternating rounds\n")
        print("| prompt | greedy text, genkit vs llama.cpp (32 tokens) |\n|---|---|")
        for i, p in enumerate(PROMPTS):
            print(f"| {p!r} | {_same_prefix(texts['genkit'][i], texts['llama.cpp'][i])} |")
        print()
        results: dict[str, dict[int, list[Any]]] = {name: {n: [] for n in args.clients} for name in clients}
        for client in clients.values():
            round_(client, 1, 1, 8)  # warm-up
        for _ in range(args.repeats):
            for n in args.clients:
                for name, client in clients.items():
                    load = os.getloadavg()[0]
                    results[name][n].append(round_(client, n, args.requests_per_client, args.new_tokens))
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
