"""``genkit serve`` under load: throughput and time to first token with 1, 8 and 32 concurrent
streaming clients on SmolLM2-135M (float32), greedy, 64 new tokens per request.

The server runs in a subprocess on 127.0.0.1 (the continuous batching engine); each client is a
thread with the ``openai`` client that sends ``--requests-per-client`` streaming completions one
after the other. Time to first token is measured from sending the request to the first text
chunk; throughput is the completion tokens of all requests (the ``usage`` of a non-streaming
check) over the wall time of the round.

Run: ``python bench/bench_serve.py [--model smollm2] [--requests-per-client 2]``

``--single N``: instead, one client's requests against ``generate()`` on the same model in this
process (the server idle meanwhile), ``N`` requests of ``--new-tokens`` tokens each (``ignore_eos``,
greedy), with a plain HTTP client (the ``openai`` client's parsing of every chunk, in the same
process as the timer, costs CPU time the server needs on a 2-core machine): streamed and not,
tokens/s and the ratio to ``generate``'s, whose tokens the non-streamed completion must equal.

``--loglikelihood N``: instead, ``N`` loglikelihood requests as lm-evaluation-harness's
``local-completions`` model sends them (token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``,
``temperature: 0``; prompts of 24 to 160 tokens of English text) from 1 and then 8 concurrent clients, against
what lm-eval's ``hf`` model does per request in this process on transformers' LlamaForCausalLM
loaded from the same GGUF (one forward over the prompt, ``log_softmax``, the tokens'
log-probabilities and the greedy check; batch 1), requests per second and the ratio; the
log-probabilities are compared (largest difference printed). Each round has its own prompts, sent in
lm-eval's order (longest first, then by tokens). ``--choices K``: multiple-choice questions
instead, a context of 64-320 tokens followed by each of K continuations of 2-12 tokens (as
lm-eval's hellaswag or arc requests: one request per choice); the share of prompt tokens the
server took from its prompt cache is printed (a scored prompt reuses an earlier one's context).

``--parallel-sampling N [--n 4] [--new-tokens 64]``: instead, N requests of ``n`` sampled choices
(temperature 0.8, seeded) over English prompts of 320 tokens, one after another, against
transformers' ``generate(num_return_sequences=n, do_sample=True)`` in this process on the same
weights; requests per second, the ratio, and the share of prompt tokens the server took from its
prompt cache (a request's choices wait for its first choice's prompt and take it from there).
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import IO

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fibonacci(n):",
           "The three most important inventions of the twentieth century are"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(base: str, proc: subprocess.Popen[str], log: IO[str] | None = None) -> None:
    """Until the server at ``base`` answers /health; an error naming its last output (``log``: the
    file its output goes to) when it exits first."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = ": ..." + log.read()[-2000:]
            raise RuntimeError(f"the server exited with code {proc.returncode} ({' '.join(map(str, proc.args))}){tail}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("the server did not start")


_FRESH = itertools.count()


def round_(client: object, clients: int, per_client: int, new: int,
           fresh: bool = False) -> tuple[list[float], float, int]:
    """One round: ``clients`` threads, each sending ``per_client`` streaming completions in turn;
    returns the times to first text, the wall time and the completion tokens. ``fresh``: each
    prompt starts with a number no request had before, so no server finds it in a prompt cache."""
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def run(worker: int) -> None:
        for j in range(per_client):
            prompt = PROMPTS[(worker + j) % len(PROMPTS)]
            if fresh:
                prompt = f"{next(_FRESH) * 7919 % 100003} {prompt}"
            t = time.perf_counter()
            first = None
            n = 0
            for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=new,  # type: ignore[attr-defined]
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - t
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            with lock:
                ttfts.append(first if first is not None else float("nan"))
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, time.perf_counter() - start, tokens[0]


def _post(base: str, body: dict) -> tuple[float, bytes]:
    """(seconds, the response body) of one POST of ``body`` to ``/v1/completions``."""
    import json

    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        raw = r.read()
    return time.perf_counter() - t, raw


def single(base: str, model_name: str, requests: int, new: int) -> None:
    """One client at a time against ``generate()`` (see the module docstring)."""
    import json

    import torch

    import genkit

    prompt = PROMPTS[1]
    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
    _post(base, {**body, "max_tokens": 16})  # warm-up
    _post(base, body)
    rates: dict[str, list[float]] = {"stream": [], "json": []}
    text = ""
    for _ in range(requests):
        for kind in rates:
            seconds, raw = _post(base, {**body, "stream": kind == "stream"})
            rates[kind].append(new / seconds)
            if kind == "json":
                text = json.loads(raw)["choices"][0]["text"]
    model, tokenizer = genkit.load_model(model_name), genkit.load_tokenizer(model_name)
    ids = torch.tensor([tokenizer.encode(prompt)])
    settings = {"max_new_tokens": new, "do_sample": False, "eos_token_id": None}
    model.generate(ids, **{**settings, "max_new_tokens": 16})
    generate_rates = []
    for _ in range(requests):
        t = time.perf_counter()
        out = model.generate(ids, **settings)
        generate_rates.append(new / (time.perf_counter() - t))
    same = tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True) == text
    best = statistics.median(generate_rates)
    print(f"one client, {requests} requests of {new} tokens, torch threads {torch.get_num_threads()}\n")
    print("| | tokens/s (median) | vs generate() |\n|---|---|---|")
    print(f"| generate() in process | {best:.1f} | 1.00x |")
    for kind, values in rates.items():
        rate = statistics.median(values)
        print(f"| genkit serve, {'streamed' if kind == 'stream' else 'not streamed'} | {rate:.1f} | {rate / best:.2f}x |")
    print(f"\nthe server's text = generate()'s: {same}")


def parallel_sampling(base: str, requests: int, n: int, new: int) -> None:
    """``requests`` completions of ``n`` sampled choices each, over English prompts of 320 tokens,
    one after another, against transformers' ``generate(num_return_sequences=n, do_sample=True)`` in
    this process on the same weights (see the module docstring)."""
    import torch
    import transformers
    from bench_models import demo_paths
    from bench_scoring import TEXT

    import genkit

    gguf, _ = demo_paths()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                           dtype=torch.float32).eval()
    text = genkit.load_tokenizer("smollm2").encode(TEXT * 12)
    prompts = [text[17 * i:17 * i + 320] for i in range(requests + 1)]
    body = {"model": "m", "n": n, "max_tokens": new, "temperature": 0.8, "ignore_eos": True}
    _post(base, {**body, "prompt": prompts[-1]})  # warm-up
    cached = _metric(base, "genkit_prompt_tokens_cached_total")
    start = time.perf_counter()
    for p in prompts[:requests]:
        _post(base, {**body, "prompt": p, "seed": 7})
    served = requests / (time.perf_counter() - start)
    share = (_metric(base, "genkit_prompt_tokens_cached_total") - cached) / (requests * n * 320)
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[-1]]), do_sample=True, max_new_tokens=4, num_return_sequences=n)
        start = time.perf_counter()
        for p in prompts[:requests]:
            hf.generate(torch.tensor([p]), do_sample=True, temperature=0.8, max_new_tokens=new, min_new_tokens=new,
                        num_return_sequences=n, top_k=0)
    ref = requests / (time.perf_counter() - start)
    print(f"{requests} requests of n={n} sampled choices (temperature 0.8), 320-token prompts, {new} new tokens, "
          f"one after another; torch threads {torch.get_num_threads()} here\n")
    print("| | requests/s | vs transformers | prompt tokens from the prompt cache |\n|---|---|---|---|")
    print(f"| transformers generate(num_return_sequences={n}) in process | {ref:.2f} | 1.00x | |")
    print(f"| genkit serve | {served:.2f} | {served / ref:.2f}x | {share:.0%} |", flush=True)


def _metric(base: str, name: str) -> float:
    """A counter of the server's ``/metrics``."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


def _loglikelihood_prompts(text: list[int], requests: int, choices: int, seed: int) -> list[list[int]]:
    """``requests`` prompts of ``text``'s tokens in the order lm-eval sends them (longest first, then
    by tokens): windows of 24-160 tokens, or with ``choices`` > 1, questions of a context of 64-320
    tokens followed by each of ``choices`` continuations of 2-12 tokens."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def window(lo: int, hi: int) -> list[int]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        s = int(torch.randint(0, len(text) - n, (1,), generator=g))
        return text[s:s + n]
    if choices <= 1:
        prompts = [window(24, 160) for _ in range(requests)]
    else:
        prompts = [ctx + window(2, 12) for ctx in (window(64, 320) for _ in range(requests // choices))
                   for _ in range(choices)]
    return sorted(prompts, key=lambda p: (-len(p), tuple(p)))


def loglikelihood(base: str, requests: int, choices: int) -> None:
    """lm-eval's loglikelihood requests against transformers in this process (see the module docstring)."""
    import json

    import torch
    import transformers
    from bench_models import demo_paths

    gguf, _ = demo_paths()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                           dtype=torch.float32).eval()
    from bench_scoring import TEXT

    import genkit

    text = genkit.load_tokenizer("smollm2").encode(TEXT * 12)
    # each round its own prompts (a round's prompts would be in the prompt cache for the next)
    rounds = {clients: _loglikelihood_prompts(text, requests, choices, seed) for seed, clients in enumerate((1, 8))}

    def reference(p: list[int]) -> list[float]:
        with torch.no_grad():
            ids = torch.tensor([p])
            lp = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
            own = lp.gather(-1, ids[0, 1:, None])[:, 0]
            _greedy = lp.argmax(-1) == ids[0, 1:]
        return own.tolist()

    def ask(p: list[int]) -> list[float]:
        body = {"model": "m", "prompt": [p], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
                "seed": 1234}
        return json.loads(_post(base, body)[1])["choices"][0]["logprobs"]["token_logprobs"][1:len(p)]

    ask(text[-20:]), reference(text[-20:])  # warm-up
    start = time.perf_counter()
    expected = {clients: [reference(p) for p in prompts] for clients, prompts in rounds.items()}
    ref_rate = 2 * len(rounds[1]) / (time.perf_counter() - start)
    shape = (f"questions of a 64-320-token context and {choices} continuations of 2-12 tokens" if choices > 1
             else "prompts of 24-160 tokens")
    print(f"{len(rounds[1])} loglikelihood requests per round (lm-eval local-completions' body and order), {shape}, "
          f"torch threads {torch.get_num_threads()} here\n")
    print("| | requests/s | vs transformers in process | prompt tokens from the prompt cache "
          "| max abs diff of the log-probabilities |\n|---|---|---|---|---|")
    print(f"| transformers forward per request (lm-eval hf, batch 1) | {ref_rate:.2f} | 1.00x | | |")
    for clients, prompts in rounds.items():
        got: list[list[float]] = [[] for _ in prompts]

        def work(worker: int, got: list[list[float]] = got, prompts: list[list[int]] = prompts) -> None:
            for i in range(worker, len(prompts), clients):
                got[i] = ask(prompts[i])
        threads = [threading.Thread(target=work, args=(w,)) for w in range(clients)]
        cached = _metric(base, "genkit_prompt_tokens_cached_total")
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = len(prompts) / (time.perf_counter() - start)
        share = (_metric(base, "genkit_prompt_tokens_cached_total") - cached) / sum(len(p) for p in prompts)
        diff = max(abs(a - b) for x, y in zip(got, expected[clients]) for a, b in zip(x, y))
        print(f"| genkit serve, {clients} client{'s' if clients > 1 else ''} | {rate:.2f} | {rate / ref_rate:.2f}x "
              f"| {share:.0%} | {diff:.1e} |", flush=True)


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--single", type=int, metavar="N", default=0,
                        help="one client's N requests against generate() instead (see above)")
    parser.add_argument("--loglikelihood", type=int, metavar="N", default=0,
                        help="N lm-eval loglikelihood requests against transformers instead (see above)")
    parser.add_argument("--parallel-sampling", type=int, metavar="N", default=0,
                        help="N requests of --n sampled choices over 320-token prompts against transformers instead")
    parser.add_argument("--n", type=int, default=4, help="choices per request of --parallel-sampling")
    parser.add_argument("--choices", type=int, default=1,
                        help="with --loglikelihood: questions of one context and this many continuations")
    args = parser.parse_args()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "genkit", "serve", "--model", args.model, "--model-name", "m",
                             "--port", str(port)], env={**os.environ}, text=True)
    try:
        _wait(base, proc)
        if args.single:
            single(base, args.model, args.single, args.new_tokens)
            return
        if args.parallel_sampling:
            parallel_sampling(base, args.parallel_sampling, args.n, args.new_tokens)
            return
        if args.loglikelihood:
            loglikelihood(base, args.loglikelihood, args.choices)
            return
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        round_(client, 1, 1, 8)  # warm-up
        print(f"genkit serve --model {args.model}: streaming completions, greedy, {args.new_tokens} new tokens, "
              f"{args.requests_per_client} requests per client\n")
        print("| concurrent clients | requests | tokens/s | TTFT p50 s | TTFT p99 s |\n|---|---|---|---|---|")
        for clients in (1, 8, 32):
            ttfts, wall, tokens = round_(client, clients, args.requests_per_client, args.new_tokens)
            ttfts.sort()
            p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
            print(f"| {clients} | {len(ttfts)} | {tokens / wall:.1f} | {statistics.median(ttfts):.3f} | {p99:.3f} |",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
