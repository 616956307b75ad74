"""Step time of cpu-tiny with EP=2: unchunked vs chunked (C=2) vs in-process logical ranks.

The three setups run side by side in mirrored rounds (A B C, C B A, ...). Restricted to any two
setups that is A B B A, so each pair is an ABBA comparison and a linear drift of the shared
machine cancels. Each run trains ``--steps`` steps; the first ``--warmup`` are dropped and the
median of the rest is that run's step time.

    python benchmarks/ep_step.py [--blocks 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from harness.abba import paired_ratio

SETUPS = {
    "unchunked (2 procs)": ["--ep", "2", "--ranks", "2"],
    "chunked C=2 (2 procs)": ["--ep", "2", "--ranks", "2", "--chunks", "2"],
    "in-process (1 proc)": ["--ep", "2", "--ranks", "1"],
}


def step_time(args: list[str], steps: int, warmup: int) -> float:
    cmd = [sys.executable, "-m", "harness.reference", *args, "--steps", str(steps), "--timing"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return statistics.median([json.loads(line)["step_time_s"] for line in out.splitlines()][warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="mirrored round pairs (each an ABBA block per pair)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    names = list(SETUPS)
    runs: list[tuple[str, float]] = []
    for _ in range(args.blocks):
        for name in names + names[::-1]:
            runs.append((name, step_time(SETUPS[name], args.steps, args.warmup)))
    base = names[0]
    print(f"{'setup':<24} {'median step (ms)':>17}   ratio vs {base}")
    for name in names:
        times = [t for n, t in runs if n == name]
        line = f"{name:<24} {1e3 * statistics.median(times):>17.1f}"
        if name != base:
            pair = [("A" if n == base else "B", t) for n, t in runs if n in (base, name)]
            line += "   " + paired_ratio(*zip(*pair), anytime=False).summary(base, name)
        print(line)


if __name__ == "__main__":
    main()
