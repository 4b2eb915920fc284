"""Qwen3 decode steps on the one-call decoder against the per-layer torch path.

Qwen3's attention RMS-normalises each head of q and k before the rotary embedding
(``q_norm``/``k_norm``); the block kernel's one-call step (``gk_decode*`` in
genkit/models/block_kernel.c) applies them since session qwen3-decode, before which a Qwen3's decode
steps ran the per-layer torch path. This writes a random Qwen3 GGUF with the tests' helper
(tests/test_quantized.py ``write_quantized_gguf``; default 12 layers, hidden 512, 8 heads of 64, 4
K/V heads, Q4_0 projections, Q8_0 embedding, vocabulary 256), loads it, and times greedy decode both
ways in one process, round after round (:func:`ab_rounds.alternate`): "torch" with the prepared
model's decoder taken away (the path before the change), "one-call" with it. ``--qtype F32`` loads
the float32 file on the ``gemv`` route (``GENKIT_KERNEL=decode:gemv``), whose one-call step is the
dense kernel's.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=. python bench/ab_qwen3_decode.py --threads 1 --rounds 5 --tokens 64``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qtype", default="Q4_0", help="projection type: Q4_0, Q4_1, Q8_0 or F32 (the gemv route)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    if args.qtype == "F32":
        os.environ["GENKIT_KERNEL"] = "decode:gemv"

    from ab_rounds import alternate
    from test_quantized import write_quantized_gguf

    import genkit
    from genkit.models.cpu import describe

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"qwen3-{args.qtype}.gguf")
        write_quantized_gguf(path, args.qtype, "F32" if args.qtype == "F32" else "Q8_0", tied=True, arch="qwen3",
                             head_dim=args.head_dim, hidden=args.hidden, ffn=3 * args.hidden, layers=args.layers,
                             heads=8, kv_heads=4)
        model = genkit.load_model(path)
    model.self_speculation = False  # (the float32 route would otherwise speculate: time the steps alone)
    ids = torch.tensor([[1, 17, 33, 5, 250, 9]])
    model.generate(ids, max_new_tokens=2, eos_token_id=None)  # prepares the layers (and builds the decoder)
    prepared = model._prepared[1]
    decoder = prepared.decoder
    if decoder is None:  # (before the change: both ways time the torch path)
        print("NOTE: this model has no one-call decoder: both ways run the torch path", flush=True)

    def switch(m: Any, one_call: bool) -> None:
        prepared.decoder = decoder if one_call else None

    print(describe(), flush=True)
    label = f"qwen3 {args.layers}x{args.hidden} head_dim {args.head_dim} {args.qtype}, {args.tokens} tokens"
    alternate(model, ids, ("torch", "one-call"), switch, [int(t) for t in args.threads.split(",")], args.rounds,
              args.tokens, label)


if __name__ == "__main__":
    main()
