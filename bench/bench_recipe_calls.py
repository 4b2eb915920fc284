"""Per-call overhead of a cached Hub recipe: ``generate(model, ids, custom_generate="org/repo")``
against calling the same recipe function directly, and the requests the Hub sees.

The Hub is tests/hub_server.py on 127.0.0.1 (the only stand-in for the Hub these machines have),
reached through the real huggingface_hub client. The recipe returns at once, so the time is the
loader's alone.

    python bench/bench_recipe_calls.py [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

RECIPE = "def generate(model, inputs=None, **kwargs):\n    return inputs\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from hub_server import HubServer

        server = HubServer().start()
        os.environ.pop("HF_HUB_OFFLINE", None)
        os.environ.update({"HF_ENDPOINT": server.endpoint, "HF_HUB_CACHE": f"{tmp}/hf/hub", "HF_HOME": f"{tmp}/hf",
                           "GENKIT_HOME": f"{tmp}/genkit", "HF_HUB_DISABLE_XET": "1",
                           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_TOKEN": "hf_bench_token_for_local_server"})
        import torch

        import genkit
        from genkit.models.tiny import tiny_llama
        from genkit.recipes import load_recipe

        server.state.commit("org/bench", {"custom_generate/generate.py": RECIPE,
                                          "README.md": "---\ntags: [custom_generate]\n---\n"})
        model, ids = tiny_llama(seed=0), torch.tensor([[1, 2, 3]])
        t0 = time.perf_counter()
        genkit.generate(model, ids, custom_generate="org/bench", trust_remote_code=True)
        first = time.perf_counter() - t0
        direct = load_recipe("org/bench", trust_remote_code=True).generate
        server.state.log.clear()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            genkit.generate(model, ids, custom_generate="org/bench", trust_remote_code=True)
        cached = (time.perf_counter() - t0) / args.calls
        requests = len(server.state.log)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            direct(model, ids)
        bare = (time.perf_counter() - t0) / args.calls
        server.stop()
    print(f"first call (resolve, fetch, check, import): {first * 1e3:.1f} ms")
    print(f"cached call: {cached * 1e6:.0f} us (direct call of the recipe function: {bare * 1e6:.1f} us); "
          f"overhead {(cached - bare) * 1e6:.0f} us per call; {requests} Hub requests in {args.calls} calls")


if __name__ == "__main__":
    main()
