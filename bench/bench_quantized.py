"""Quantized GGUF on the CPU: genkit's block kernel against llama.cpp, on the same file, same run.

Batch-1 greedy decode tokens/s after a 12-token prompt, on ``SmolLM2-135M-Instruct.Q4_1.gguf``
(the demo model's file), 1 and 2 threads: genkit with the file's tensors kept quantized
(``load_model(path)``), genkit de-quantized to float32 (``dequantize=True``), and llama.cpp
(``llama-cpp-python``, which must be installed in a separate venv: give its python with
``--llama-python``; it is never a genkit dependency). Decode time is the time of a generation of
``N + 1`` tokens minus that of 1 token (the prompt's prefill), best of ``--repeats``.

Also: batch-8 sampling and 4-beam search, quantized against float32; and bfloat16 against float32 on
the converted safetensors folder.

Build llama.cpp's binding once (about 10 minutes on 2 cores):
``python -m venv /tmp/llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp/bin/pip install
llama-cpp-python==0.3.36``

Run: ``python bench/bench_quantized.py --llama-python /tmp/llamacpp/bin/python``; with
``--llama-bench build/bin/llama-bench`` (llama.cpp built as in bench_serve_vs_llamacpp.py) it first
prints llama-bench's tg128 and pp512 beside genkit's (``--only-llama-bench``: only that table).
``--activation-digits 1,2`` measures genkit's quantized model with each activation rounding (1:
llama.cpp's, 2: the default), in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import genkit
from genkit.models.cpu import describe
from genkit.models.demo import demo_gguf_path, genkit_home

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import _time  # noqa: E402  (best-of-n timing, shared by the benches)

PROMPT = "Write a short story about a robot who learns to paint. Once upon a"

LLAMA_CPP = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, new, repeats, ids = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, n_batch=64, verbose=False)
def run(n):
    llm.reset()
    out = []
    t = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return time.perf_counter() - t, out
run(8)
best, tokens = float("inf"), None
for _ in range(repeats):
    t_full, out = run(new + 1)
    t_one, _ = run(1)
    best = min(best, t_full - t_one)
    tokens = out
print(json.dumps({"decode_s": best, "tokens": tokens}))
"""


def _genkit_decode(model: Any, ids: torch.Tensor, new: int, repeats: int,
                   clock: Any = time.perf_counter) -> tuple[float, list[int]]:
    kw = {"max_new_tokens": 1, "eos_token_id": None, "pad_token_id": 0}
    model.generate(ids, **{**kw, "max_new_tokens": 8})
    best, tokens = float("inf"), []
    for _ in range(repeats):
        t = clock()
        out = model.generate(ids, **{**kw, "max_new_tokens": new + 1})
        t_full = clock() - t
        t = clock()
        model.generate(ids, **kw)
        t_one = clock() - t
        best = min(best, t_full - t_one)
        tokens = out[0, ids.shape[1]:].tolist()
    return best, tokens


def _genkit_prefill(model: Any, n: int, repeats: int, clock: Any = time.perf_counter) -> float:
    """Tokens/s of one forward over an ``n``-token prompt (filling a cache), best of ``repeats``; the
    logits of the last position only, as ``generate``'s prefill and llama-bench's pp test compute them
    (llama.cpp outputs only the last token of a batch given without a logits array)."""
    ids = torch.randint(3, 40000, (1, n), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    with torch.inference_mode():
        model(ids[:, :16], use_cache=True)
        for _ in range(repeats):
            t = clock()
            model(ids, use_cache=True, logits_to_keep=1)
            best = min(best, clock() - t)
    return n / best


def _llama_bench_rates(llama_bench: str, path: str, threads: int, repeats: int, cpu_time: bool,
                       prompt_bench: str | None = None) -> dict[str, float]:
    """llama-bench's tg128 and pp512 tokens/s (pp512 from ``prompt_bench`` when given: a second
    build, for a CPU where the first one's prompt path crashes); with ``cpu_time``, tokens per
    CPU-second of the child (each test run alone with ``--no-warmup``, less the CPU time of a
    1-token run: loading)."""
    base = [llama_bench, "-m", path, "-t", str(threads), "-r", str(repeats), "-o", "json"]
    if not cpu_time:
        runs = [[*base, "-p", "512", "-n", "128"]] if prompt_bench is None else [
            [*base, "-p", "0", "-n", "128"], [prompt_bench, *base[1:], "-p", "512", "-n", "0"]]
        rates = {}
        for cmd in runs:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rates.update({("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in json.loads(out.stdout)})
        return rates
    if prompt_bench is not None:
        raise SystemExit("--llama-bench-prompt does not go with --cpu-time")

    def cpu(args: list[str]) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([*base, "--no-warmup", *args], capture_output=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime

    load = cpu(["-p", "0", "-n", "1"])
    return {"tg128": 127 * repeats / (cpu(["-p", "0", "-n", "128"]) - load),
            "pp512": 512 * repeats / (cpu(["-p", "512", "-n", "0"]) - load)}


def llama_bench_table(llama_bench: str, path: str, models: dict[str, Any], threads: list[int], repeats: int,
                      rounds: int = 1, cpu_time: bool = False, prompt_bench: str | None = None) -> None:
    """llama.cpp's ``llama-bench`` (tg128: decode 128 tokens; pp512: a 512-token prompt) against genkit's
    decode of 128 tokens after a 12-token prompt and one forward over 512 tokens: ``rounds`` rounds,
    each running llama-bench and then genkit, so that both see the same machine; medians of the rounds.
    ``cpu_time`` (1 thread only): tokens per CPU-second instead of per second, for a shared machine
    where wall time measures each process's share of the CPUs more than its speed."""
    unit = "tok/CPU-s" if cpu_time else "tok/s"
    print(f"\n| threads | test | llama.cpp {unit} | " + " | ".join(f"{n} {unit}" for n in models) +
          " | genkit Q4_1 / llama.cpp | load average |\n|---|---|---|" + "---|" * len(models) + "---|---|")
    quantized = [n for n in models if n.startswith("genkit Q4_1")]
    ids = torch.randint(3, 40000, (1, 12), generator=torch.Generator().manual_seed(1))
    tests = ("tg128", "pp512")
    for t in threads:
        torch.set_num_threads(t)
        ref: dict[str, list[float]] = {test: [] for test in tests}
        ours: dict[str, dict[str, list[float]]] = {name: {test: [] for test in tests} for name in models}
        for _ in range(rounds):
            for test, rate in _llama_bench_rates(llama_bench, path, t, repeats, cpu_time, prompt_bench).items():
                ref[test].append(rate)
            clock = time.process_time if cpu_time else time.perf_counter
            for name, m in models.items():
                ours[name]["tg128"].append(128 / _genkit_decode(m, ids, 128, repeats, clock)[0])
                ours[name]["pp512"].append(_genkit_prefill(m, 512, repeats, clock))
        load = os.getloadavg()[0]
        for test in tests:
            cells = " | ".join(f"{statistics.median(ours[n][test]):.1f}" for n in models)
            ratios = ", ".join(f"{statistics.median(ours[n][test]) / statistics.median(ref[test]):.2f}x"
                               for n in quantized)
            print(f"| {t} | {test} | {statistics.median(ref[test]):.1f} | {cells} | {ratios} | {load:.2f} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-python", help="python of a venv with llama-cpp-python (skipped if not given)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: adds the tg128 / pp512 table")
    parser.add_argument("--llama-bench-prompt", help="a second llama-bench build for pp512 (where the first one's "
                        "prompt path crashes: llama.cpp's AMX tiles on some Xeons)")
    parser.add_argument("--only-llama-bench", action="store_true", help="just the llama-bench table")
    parser.add_argument("--rounds", type=int, default=1,
                        help="llama-bench table: rounds of llama-bench then genkit (medians reported)")
    parser.add_argument("--no-float32", action="store_true", help="llama-bench table: leave out genkit float32")
    parser.add_argument("--activation-digits", default="2",
                        help="genkit Q4_1's activation digits, comma-separated (1,2: both, interleaved)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="llama-bench table: tokens per CPU-second (a shared machine; 1 thread only)")
    args = parser.parse_args()
    print(describe(), flush=True)  # the CPU kind these figures belong to
    if args.cpu_time and args.threads != "1":
        parser.error(f"--cpu-time measures one thread (spinning threads count as CPU time); got --threads {args.threads}")
    path = demo_gguf_path(f"{genkit_home()}/bench-gguf")
    tok = genkit.load_tokenizer(path)
    ids = tok([PROMPT], return_tensors="pt")["input_ids"][:, :12]
    digits = [int(d) for d in args.activation_digits.split(",")]
    variants = {_variant_name(d, digits): genkit.load_model(path, activation_digits=d) for d in digits}
    quantized = next(iter(variants.values()))
    dense = None if args.no_float32 and args.only_llama_bench else genkit.load_model(path, dequantize=True)
    new = args.new_tokens
    if args.llama_bench:
        table = dict(variants) if args.no_float32 else {**variants, "genkit float32": dense}
        llama_bench_table(args.llama_bench, path, table, [int(t) for t in args.threads.split(",")], args.repeats,
                          args.rounds, args.cpu_time, args.llama_bench_prompt)
        if args.only_llama_bench:
            return
    print(f"{path}: batch-1 greedy decode, {ids.shape[1]}-token prompt, {new} new tokens, best of {args.repeats}; "
          f"torch {torch.__version__}\n")
    print("| threads | engine | tok/s | vs llama.cpp | same tokens as llama.cpp |\n|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        ref = None
        if args.llama_python:
            out = subprocess.run([args.llama_python, "-c", LLAMA_CPP, path, str(threads), str(new), str(args.repeats),
                                  json.dumps(ids[0].tolist())], capture_output=True, text=True, check=True)
            ref = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {threads} | llama.cpp | {new / ref['decode_s']:.1f} | 1.00x | |")
        for name, model in (*variants.items(), ("genkit float32 (de-quantized)", dense)):
            secs, tokens = _genkit_decode(model, ids, new, args.repeats)
            ratio = f"{ref['decode_s'] / secs:.2f}x" if ref else "-"
            same = "-" if ref is None else _same(tokens, ref["tokens"][:new])
            print(f"| {threads} | {name} | {new / secs:.1f} | {ratio} | {same} |")

    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    print("\n| workload | Q4_1 quantized s | float32 s | speed-up |\n|---|---|---|---|")
    prompts = tok([PROMPT] * 8, return_tensors="pt")
    workloads = {
        "batch 8, sampling, 64 new tokens": lambda m: (torch.manual_seed(0), m.generate(
            **prompts, do_sample=True, max_new_tokens=64, eos_token_id=None)),
        "4 beams, 64 new tokens": lambda m: m.generate(ids, num_beams=4, max_new_tokens=64, eos_token_id=None),
    }
    for name, work in workloads.items():
        tq = _time(lambda w=work: w(quantized), args.repeats)
        tf = _time(lambda w=work: w(dense), args.repeats)
        print(f"| {name} | {tq:.2f} | {tf:.2f} | {tf / tq:.2f}x |")

    folder = genkit.models.demo.ensure_demo_model()
    print("\n| safetensors folder, batch-1 greedy decode | tok/s |\n|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        model = genkit.load_model(folder, dtype=dtype)
        secs, _ = _genkit_decode(model, ids, new, args.repeats)
        print(f"| {str(dtype).replace('torch.', '')} | {new / secs:.1f} |")


def _variant_name(digits: int, measured: list[int]) -> str:
    """The quantized model's column: ``genkit Q4_1``, or with its activation digits when several run."""
    return "genkit Q4_1" if measured == [2] else f"genkit Q4_1 ({digits} digit{'s' if digits > 1 else ''})"


def _same(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return "yes" if n is None and len(a) == len(b) else f"first {n} tokens"


if __name__ == "__main__":
    sys.exit(main())
