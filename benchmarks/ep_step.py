"""Step time of cpu-tiny with EP=2: unchunked vs chunked (C=2) vs in-process logical ranks.

The three setups run side by side, in rotating order (ABC, CBA, ...), so drift on a shared
machine hits all of them alike. Each run trains ``--steps`` steps; the first ``--warmup`` are
dropped and the median of the rest is that run's step time. Ratios are per round against the
unchunked 2-process setup, summarised as a geometric mean with a 95% interval.

    python benchmarks/ep_step.py [--rounds 4] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys

SETUPS = {
    "unchunked (2 procs)": ["--ep", "2", "--ranks", "2"],
    "chunked C=2 (2 procs)": ["--ep", "2", "--ranks", "2", "--chunks", "2"],
    "in-process (1 proc)": ["--ep", "2", "--ranks", "1"],
}


def step_time(args: list[str], steps: int, warmup: int) -> float:
    cmd = [sys.executable, "-m", "harness.reference", *args, "--steps", str(steps), "--timing"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    times = [json.loads(line)["step_time_s"] for line in out.splitlines()][warmup:]
    return statistics.median(times)


def interval(log_ratios: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(log_ratios)
    half = 1.96 * statistics.stdev(log_ratios) / math.sqrt(len(log_ratios)) if len(log_ratios) > 1 else float("nan")
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    names = list(SETUPS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(step_time(SETUPS[name], args.steps, args.warmup))
    base = names[0]
    print(f"{'setup':<24} {'median step (ms)':>17} {'ratio vs unchunked':>20}  95% interval")
    for name in names:
        ratio, low, high = interval([math.log(t / b) for t, b in zip(times[name], times[base])])
        print(f"{name:<24} {1e3 * statistics.median(times[name]):>17.1f} {ratio:>20.3f}  [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
