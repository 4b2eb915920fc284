"""A self-speculative check's time, the float32 LM head read whole against through its 8-bit copy.

A check (``BlockDecoder.verify``, ``gk_decode_verify``) runs the pending token and the drafts as T
rows of one step and gives each row's greedy token. It can read the float32 head whole, or through
its 8-bit copy (one 8-bit product for all rows, then per row the exact logits of the blocks that can
hold its largest); the pace (``genkit.models.self_speculation.Pace``) times both ways per T and keeps
the faster. This times both in one process, alternating, on the demo model's float32 conversion
(SmolLM2-135M-Instruct) after a 12-token prompt and 4 new tokens, checks that they give the same
tokens, and prints ms per check and the ratio.

Run: ``python bench/bench_check_head.py --threads 1,2 --rounds 15``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import genkit
from genkit.models.cpu import describe
from genkit.models.demo import ensure_demo_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(describe(), flush=True)
    os.environ["GENKIT_KERNEL"] = "decode:gemv"  # (the one-call route, whose greedy steps speculate)
    model = genkit.load_model(ensure_demo_model())
    model.self_speculation = False
    ids = torch.randint(3, 30000, (1, 12), generator=torch.Generator().manual_seed(1))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                             return_dict_in_generate=True)
        cache = out.past_key_values
        prepared = model._weights_on(cache)[1]
        decoder, ends = prepared.decoder, model.kernel_ends(prepared)
        pos = cache.lengths[0]
        for t in (1, 2, 4, 8, 12, 16):
            tokens = torch.randint(3, 30000, (t,), generator=torch.Generator().manual_seed(t))
            cos, sin = model.rope(None, torch.float32, pos, t)
            cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
            times: dict[bool, list[float]] = {False: [], True: []}
            got: dict[bool, list[int]] = {}
            with torch.inference_mode():
                for _ in range(args.rounds + 1):  # (the first round warms up: the copy is made in it)
                    for copy in (False, True):
                        start = time.perf_counter()
                        got[copy] = decoder.verify(tokens, cos, sin, cache, ends, head_copy=copy).tolist()
                        times[copy].append(time.perf_counter() - start)
                        cache.lengths[:] = [pos] * len(cache.lengths)
            whole, through = (statistics.median(times[c][1:]) * 1e3 for c in (False, True))
            print(f"{threads} thread(s), T={t:2d}: whole head {whole:6.2f} ms, through the 8-bit copy {through:6.2f} ms, "
                  f"{whole / through:.2f}x; same tokens: {got[False] == got[True]}", flush=True)


if __name__ == "__main__":
    main()
