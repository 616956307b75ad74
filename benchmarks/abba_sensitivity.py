"""How many ABBA blocks `harness abba` needs to see a slowdown, and how often it cries wolf.

Two identical arms (cpu-tiny, EP=2 on 2 ranks, eager); the B arm gets a planted slowdown, the
documented fault ``debug.slow_fraction`` (every step of ``debug.slow_arm`` sleeps that fraction of
its own duration). For each planted fraction one ``harness abba`` run records ``--blocks`` blocks;
the statistic of the gate (harness.abba.paired_ratio) is then taken over its first k blocks, for
every k, to find the fewest blocks from which the slowdown is detected for good: the interval's
lower bound stays above 1 (B slower, 95% confidence), and above 1 + max_slowdown (the gate fails).

False alarms: one A/A run (no fault) of ``--repetitions`` x ``--aa-blocks`` blocks, split into
that many disjoint runs of ``--aa-blocks`` blocks each, each judged as the gate would: how many
fail the gate, and how many have an interval that excludes 1 either way (nominally 5%).

    python benchmarks/abba_sensitivity.py [--blocks 10] [--steps 5] [--repetitions 20] [--aa-blocks 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.abba import paired_ratio

SUITE = """
name = "abba-sensitivity"
description = "two identical arms for benchmarks/abba_sensitivity.py"
ranks = 2
steps = 5
[model]
config = "cpu-tiny"
[train]
seed = 42
routing = "forced-balanced"
local_batch = 4
seq_len = 32
[arms.base]
[arms.twin]
[throughput]
a = "base"
b = "twin"
"""
MAX_SLOWDOWN = 0.05


def record(suite: Path, out: Path, blocks: int, steps: int, fraction: float) -> list[dict]:
    """The main-series rows of one `harness abba` run."""
    fault = ["--set", "debug.slow_arm=twin", "--set", f"debug.slow_fraction={fraction}"] if fraction else []
    command = [sys.executable, "-m", "harness", "abba", str(suite), "--blocks", str(blocks), "--steps", str(steps)]
    subprocess.run([*command, "--out", str(out), *fault], check=False, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()]
    return [r for r in rows if r["series"] == "main"]


def judged(rows: list[dict]) -> tuple[float, float, float]:
    """(ratio, low, high) of B/A step time over these whole blocks."""
    result = paired_ratio([r["role"] for r in rows], [r["step_time_s"] for r in rows])
    return result.ratio, result.low, result.high


def detected_from(rows: list[dict], bound: float) -> int | None:
    """The fewest blocks k such that the lower bound over the first j blocks exceeds ``bound`` for every j >= k."""
    blocks = len(rows) // 4
    above = [judged(rows[: 4 * k])[1] > bound for k in range(2, blocks + 1)]
    for k in range(2, blocks + 1):
        if all(above[k - 2 :]):
            return k
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10, help="blocks per planted slowdown")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block position")
    parser.add_argument("--repetitions", type=int, default=20, help="A/A repetitions")
    parser.add_argument("--aa-blocks", type=int, default=4, help="blocks per A/A repetition")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "suite.toml"
        suite.write_text(SUITE)
        print(f"planted slowdown of B; {args.blocks} blocks of {args.steps} steps per position; EP=2 on 2 ranks")
        print(f"{'planted':>8} {'B/A over all blocks [95% CI]':>32} {'B/A > 1 from':>14} {'gate fails from':>16}")
        for fraction in (0.05, 0.10, 0.20):
            rows = record(suite, Path(tmp) / f"slow{fraction}", args.blocks, args.steps, fraction)
            ratio, low, high = judged(rows)
            slower = detected_from(rows, 1.0)
            gate = detected_from(rows, 1 + MAX_SLOWDOWN)
            shown = [f"{k} blocks" if k else f"not in {args.blocks}" for k in (slower, gate)]
            print(f"{fraction:>8.0%} {f'{ratio:.3f} [{low:.3f}, {high:.3f}]':>32} {shown[0]:>14} {shown[1]:>16}")

        blocks = args.repetitions * args.aa_blocks
        rows = record(suite, Path(tmp) / "aa", blocks, args.steps, 0.0)
        runs = [rows[4 * args.aa_blocks * i : 4 * args.aa_blocks * (i + 1)] for i in range(args.repetitions)]
        verdicts = [judged(run) for run in runs]
        fails = sum(low > 1 + MAX_SLOWDOWN for _, low, _ in verdicts)
        excludes = sum(low > 1 or high < 1 for _, low, high in verdicts)
        ratios = ", ".join(f"{ratio:.3f}" for ratio, _, _ in verdicts)
        print(f"A/A, {args.repetitions} runs of {args.aa_blocks} blocks: gate fails {fails}/{args.repetitions},")
        print(f"  interval excludes 1 in {excludes}/{args.repetitions}; ratios {ratios}")


if __name__ == "__main__":
    main()
