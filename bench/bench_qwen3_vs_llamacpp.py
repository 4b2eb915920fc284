"""Qwen3 GGUF files: genkit against llama.cpp on the same file, greedy tokens and speed.

``tokens``: random Qwen3 files written by the tests' helper (tests/test_quantized.py
``write_quantized_gguf``: F32, Q8_0, Q4_0, Q4_1, Q4_K/Q6_K projections; a ``head_dim`` other than
hidden / heads, given as ``qwen3.attention.key_length``; tied and untied output; grouped K/V heads),
each decoded greedily for ``--new-tokens`` steps by ``llama-server`` (``/completion`` with the prompt
as token ids, ``temperature: 0``, ``n_probs``, ``cache_prompt: false``, ``ignore_eos``) and by
``genkit.load_model(path).generate`` (``numerics="genkit"``: Qwen3 refuses ``"llama.cpp"``). Per file:
whether the tokens are the same, else the first step that differs and llama.cpp's margin there
(its best log-probability less its second best: a near tie if small), and the largest difference
of llama.cpp's top log-probabilities over the steps before. The F32 files run once more with
``-ctk f32 -ctv f32 -fa off`` (float32 K/V and attention, as genkit's): what is left is the order of
float sums.

``speed`` (``--llama-bench``): a random Qwen3 of Qwen3-0.6B's shape (28 layers, hidden 1024, 16
heads of 128, 8 K/V heads, intermediate 3072, vocabulary 151936; Q4_0 projections, Q8_0 tied
embedding; ``--layers``/``--vocab`` to shrink it), llama-bench's tg128 and pp512 against genkit's
decode of 128 tokens after a 12-token prompt and one forward over 512 tokens
(bench/bench_quantized.py's measures), in alternating rounds, medians; ratios genkit / llama.cpp.

``numerics`` (with ``--llama-server``): ``numerics="llama.cpp"`` on random Llama Q4_0/Q4_1/Q8_0 files
against llama-server's defaults and ``--no-repack`` (llama.cpp repacks Q4_0 on AVX2 CPUs).

llama.cpp is never a genkit dependency: build it as bench/bench_serve_vs_llamacpp.py says. The helper
writes no BPE merges, which llama.cpp's loader requires of a ``gpt2`` vocabulary: this bench gives the
files one (``t 1``; the prompts are token ids, so no text is ever tokenized).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_qwen3_vs_llamacpp.py --llama-server
build/bin/llama-server --llama-bench build/bin/llama-bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import gguf  # noqa: E402
from bench_quantized import _genkit_decode, _genkit_prefill, _llama_bench_rates  # noqa: E402
from test_quantized import write_quantized_gguf  # noqa: E402

import genkit  # noqa: E402
from genkit.models.cpu import describe  # noqa: E402

PROMPT = [1, 17, 42, 99, 5, 23, 7, 8]
EOS = 2  # write_quantized_gguf's end-of-sequence token
# name: write_quantized_gguf's arguments (arch="qwen3", seed 4 and 2 layers unless given)
CASES: dict[str, dict[str, Any]] = {
    "F32, untied, head_dim 32 (hidden 64 / 4 heads = 16), GQA 4:2": dict(qtype="F32", embed_qtype="F32", tied=False,
                                                                       head_dim=32),
    "F32, tied, hidden 256, 4 heads of 128, 2 K/V heads": dict(qtype="F32", embed_qtype="F32", hidden=256, ffn=512,
                                                             head_dim=128, kv_heads=2),
    "Q8_0, tied Q8_0, head_dim 32, GQA 4:2": dict(qtype="Q8_0", head_dim=32),
    "Q8_0, untied, hidden 256, 4 heads of 64, 2 K/V heads": dict(qtype="Q8_0", tied=False, hidden=256, ffn=512,
                                                               head_dim=64, kv_heads=2),
    "Q4_0, untied, hidden 128, 4 heads of 64, 2 K/V heads": dict(qtype="Q4_0", tied=False, hidden=128, ffn=256,
                                                               head_dim=64, kv_heads=2),
    "Q4_0, tied Q8_0, hidden 256, 4 heads of 128, 4 K/V heads": dict(qtype="Q4_0", hidden=256, ffn=512, head_dim=128,
                                                                   kv_heads=4),
    "Q4_1, untied, hidden 256, 8 heads of 64, 2 K/V heads, 4 layers": dict(qtype="Q4_1", tied=False, hidden=256,
                                                                         ffn=512, heads=8, kv_heads=2, head_dim=64,
                                                                         layers=4),
    "Q4_K, tied Q8_0, hidden 256, 4 heads of 128, 2 K/V heads": dict(qtype="Q4_K", hidden=256, ffn=512, head_dim=128,
                                                                   kv_heads=2),
    "Q6_K, untied, hidden 256, 2 heads of 128, 1 K/V head": dict(qtype="Q6_K", tied=False, hidden=256, ffn=512,
                                                               heads=2, kv_heads=1, head_dim=128),
}
F32_FLAGS = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]


def write(path: str, **kw: Any) -> None:
    """write_quantized_gguf (a Qwen3 unless ``arch``) with one BPE merge, which llama.cpp's loader needs."""
    merges = gguf.GGUFWriter.add_token_merges
    gguf.GGUFWriter.add_token_merges = lambda self, m: merges(self, list(m) or ["t 1"])  # type: ignore[method-assign]
    try:
        write_quantized_gguf(path, **{"arch": "qwen3", "seed": 4, **kw})
    finally:
        gguf.GGUFWriter.add_token_merges = merges  # type: ignore[method-assign]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_greedy(server: str, path: str, new: int, flags: list[str]) -> dict[str, Any]:
    """llama-server's greedy completion of PROMPT (token ids), with each step's top log-probabilities;
    the server is started on 127.0.0.1 with one thread and stopped after."""
    port = _free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([server, "-m", path, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
                             "-c", "256", "--parallel", "1", "--no-webui", *flags], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"llama-server did not start:\n{log.read()[-2000:]}")
            time.sleep(0.2)
        body = {"prompt": PROMPT, "n_predict": new, "temperature": 0, "n_probs": 2, "cache_prompt": False,
                "return_tokens": True, "ignore_eos": True}
        req = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.load(r)  # type: ignore[no-any-return]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def genkit_greedy(path: str, new: int, **load: Any) -> tuple[list[int], list[torch.Tensor]]:
    """genkit's greedy tokens after PROMPT and each step's log-probabilities (of the raw logits); the
    end-of-sequence token is never chosen, as llama-server's ``ignore_eos`` (a -inf bias on it)."""
    model = genkit.load_model(path, **load)
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             suppress_tokens=[EOS], output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(PROMPT):].tolist(), [torch.log_softmax(s[0].double(), -1) for s in out.logits]


def compare(ref: dict[str, Any], tokens: list[int], logprobs: list[torch.Tensor]) -> str:
    """A table row's cells: same tokens or the first difference with llama.cpp's margin there, and
    the largest log-probability difference before it."""
    steps = ref["completion_probabilities"]
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b), None)
    upto = len(tokens) if first is None else first
    diff = max((abs(t["logprob"] - float(logprobs[i][t["id"]])) for i in range(upto) for t in steps[i]["top_logprobs"]),
               default=0.0)
    if first is None:
        return f"yes ({len(tokens)}) | | {diff:.1e}"
    top = steps[first]["top_logprobs"]
    return f"no: step {first} | {top[0]['logprob'] - top[1]['logprob']:.4f} | {diff:.1e}"


def tokens_table(server: str, new: int, folder: str) -> None:
    print(f"\n{new} greedy steps after {len(PROMPT)} prompt ids; llama-server defaults unless said\n")
    print("| file | llama-server flags | same tokens | llama.cpp's top-2 margin there | max abs. logprob diff before |"
          "\n|---|---|---|---|---|")
    for i, (name, kw) in enumerate(CASES.items()):
        path = os.path.join(folder, f"case{i}.gguf")
        write(path, **kw)
        tokens, logprobs = genkit_greedy(path, new)
        for flags in ([], F32_FLAGS) if kw["qtype"] == "F32" else ([],):
            ref = llama_server_greedy(server, path, new, flags)
            print(f"| {name} | {' '.join(flags) or '(defaults)'} | {compare(ref, tokens, logprobs)} |", flush=True)


def numerics_table(server: str, new: int, folder: str) -> None:
    """``numerics="llama.cpp"`` on random Llama files (the Qwen3 ones refuse it) against llama-server
    with its defaults and with ``--no-repack``: llama.cpp repacks Q4_0 weights on an AVX2 CPU."""
    print(f"\nnumerics='llama.cpp' on Llama files (hidden 256, 4 heads of 64, 2 layers), {new} greedy steps: "
          "steps whose top log-probabilities are llama.cpp's within 2e-6\n")
    print("| file | llama-server flags | same tokens | llama.cpp's top-2 margin there | max abs. logprob diff before | "
          "steps within 2e-6 |\n|---|---|---|---|---|---|")
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        path = os.path.join(folder, f"llama-{qtype}.gguf")
        write(path, qtype=qtype, arch="llama", hidden=256, ffn=512)
        tokens, logprobs = genkit_greedy(path, new, numerics="llama.cpp")
        for flags in ([], ["--no-repack"]):
            ref = llama_server_greedy(server, path, new, flags)
            steps = ref["completion_probabilities"]
            exact = sum(all(abs(t["logprob"] - float(logprobs[i][t["id"]])) < 2e-6 for t in steps[i]["top_logprobs"])
                        for i in range(len(steps)))
            print(f"| Llama {qtype} | {' '.join(flags) or '(defaults)'} | {compare(ref, tokens, logprobs)} | {exact} |",
                  flush=True)


def speed_table(bench: str, folder: str, layers: int, vocab: int, rounds: int, repeats: int) -> None:
    path = os.path.join(folder, "qwen3-0.6b-shape-q4_0.gguf")
    t = time.perf_counter()
    write(path, qtype="Q4_0", embed_qtype="Q8_0", tied=True, hidden=1024, ffn=3072, heads=16, kv_heads=8,
          head_dim=128, layers=layers, vocab=vocab)
    print(f"\nQwen3 {layers} layers, hidden 1024, 16 heads of 128, 8 K/V heads, intermediate 3072, vocabulary {vocab}; "
          f"Q4_0 projections, Q8_0 tied embedding ({os.path.getsize(path) / 2**20:.0f} MiB, written in "
          f"{time.perf_counter() - t:.0f} s); 1 thread, {rounds} alternating rounds (medians), best of {repeats} each\n")
    torch.set_num_threads(1)
    model = genkit.load_model(path)
    ids = torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(1))
    ref: dict[str, list[float]] = {"tg128": [], "pp512": []}
    ours: dict[str, list[float]] = {"tg128": [], "pp512": []}
    for _ in range(rounds):
        for test, rate in _llama_bench_rates(bench, path, 1, repeats, False).items():
            ref[test].append(rate)
        ours["tg128"].append(128 / _genkit_decode(model, ids, 128, repeats)[0])
        ours["pp512"].append(_genkit_prefill(model, 512, repeats))
    print("| test | llama.cpp tok/s | genkit tok/s | genkit / llama.cpp | load average |\n|---|---|---|---|---|")
    for test in ("tg128", "pp512"):
        a, b = statistics.median(ref[test]), statistics.median(ours[test])
        print(f"| {test} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {os.getloadavg()[0]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", help="llama.cpp's llama-server: the tokens table")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench: the speed table")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=28, help="speed table: layers (Qwen3-0.6B: 28)")
    ap.add_argument("--vocab", type=int, default=151936, help="speed table: vocabulary (Qwen3-0.6B: 151936)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(describe(), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        if args.llama_server:
            tokens_table(args.llama_server, args.new_tokens, folder)
            numerics_table(args.llama_server, args.new_tokens, folder)
        if args.llama_bench:
            speed_table(args.llama_bench, folder, args.layers, args.vocab, args.rounds, args.repeats)


if __name__ == "__main__":
    main()
