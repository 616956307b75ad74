"""How often the adaptive ABBA gate cries wolf, how often its interval misses, and how many blocks
it takes to see a planted slowdown, on this machine.

Two identical arms (cpu-tiny, EP=2 on 2 ranks, eager); a planted slowdown makes every step of B
sleep a fraction of its own duration (``debug.slow_fraction``). Each planted fraction is recorded
by real `harness abba` runs of fixed ``--record`` blocks; the record is then cut into consecutive
gate runs, each judged exactly as ``--blocks auto`` judges a run (harness.throughput.stop_reason
after every block, with harness.abba's confidence sequence): a run ends when its interval clears
the 5% threshold (pass or fail) or at ``--max-blocks`` (inconclusive). A run's wall time is the
measuring time of its blocks. Beside each, the statistic the gate had before (a Student-t
interval over the blocks so far) is looked at after every block of the same runs.

    python benchmarks/abba_sensitivity.py [--aa-runs 100] [--aa-max-blocks 12] [--runs 10] [--max-blocks 60]

Acceptance (docs/throughput.md): over the A/A runs the interval covers 1 in >= 93% and the gate
fails <= 1%; 0% passes; 10% fails, 20% fails in fewer blocks; 5% (the threshold itself) is failed
or inconclusive in >= 80% of runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from harness.abba import block_log_ratios, gate_verdict, paired_ratio
from harness.specs import ThroughputSpec
from harness.throughput import measuring_seconds, stop_reason, whole_blocks

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
    """The main-series rows of one `harness abba` run of ``blocks`` fixed blocks."""
    fault = ["--set", "debug.slow_arm=twin", "--set", f"debug.slow_fraction={fraction}"] if fraction else []
    command = [sys.executable, "-m", "harness", "abba", str(suite), "--blocks", str(blocks), "--steps", str(steps)]
    subprocess.run([*command, "--out", str(out), *fault], check=False, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()]
    return [r for r in rows if r["series"] == "main"]


def student_t(rows: list[dict]) -> tuple[str, float, float] | None:
    """The old gate on these blocks: (verdict, low, high) of the fixed-sample Student-t interval."""
    roles, times, _ = whole_blocks(rows, "main")
    if len(roles) < 8:
        return None
    ratio = paired_ratio(roles, times, anytime=False)
    return gate_verdict(ratio.low, ratio.high, 1 + MAX_SLOWDOWN), ratio.low, ratio.high


def gate_runs(rows: list[dict], max_blocks: int) -> tuple[list[dict], list[tuple]]:
    """Cuts a record into consecutive adaptive gate runs; a run the record cannot finish is dropped.
    Returns the runs (verdict, blocks, low, high, seconds) and the old statistic's on the same blocks."""
    spec = ThroughputSpec("base", "twin", blocks="auto", max_blocks=max_blocks, budget_s=math.inf)
    blocks = [rows[i : i + 4] for i in range(0, len(rows) - 3, 4)]
    runs, old = [], []
    start = 0
    while start < len(blocks):
        old_verdict = None  # the old statistic stops at the first block where it decides
        for end in range(start + 1, len(blocks) + 1):
            segment = [row for block in blocks[start:end] for row in block]
            if old_verdict is None:
                judged = student_t(segment)
                old_verdict = judged if judged and judged[0] != "inconclusive" else None
            if stop_reason(spec, segment):
                roles, times, _ = whole_blocks(segment, "main")
                ratio = paired_ratio(roles, times)
                verdict = gate_verdict(ratio.low, ratio.high, 1 + MAX_SLOWDOWN)
                runs.append(
                    {"verdict": verdict, "blocks": end - start, "low": ratio.low, "high": ratio.high,
                     "seconds": measuring_seconds(segment)}
                )  # fmt: skip
                old.append(old_verdict or student_t(segment))
                start = end
                break
        else:
            break
    return runs, old


def collect(suite: Path, tmp: Path, fraction: float, runs: int, max_blocks: int, chunk: int, steps: int):
    """Records chunks of ``chunk`` blocks until they hold ``runs`` gate runs; returns those runs, the
    old statistic's verdicts on them, and every block's log ratio."""
    all_runs, all_old, log_ratios = [], [], []
    while len(all_runs) < runs:
        rows = record(suite, tmp / f"f{fraction}-{len(log_ratios)}", chunk, steps, fraction)
        cut, old = gate_runs(rows, max_blocks)
        all_runs += cut
        all_old += old
        roles, times, _ = whole_blocks(rows, "main")
        log_ratios += block_log_ratios(roles, times)
    return all_runs[:runs], all_old[:runs], log_ratios


def share(runs: list[dict], verdict: str) -> float:
    return sum(r["verdict"] == verdict for r in runs) / len(runs)


def describe_blocks(log_ratios: list[float]) -> str:
    """What the per-block log ratios look like: the grounds for the statistic."""
    logs = pd.Series(log_ratios)
    return (
        f"{len(logs)} blocks: log ratio sd {logs.std():.3f}, excess kurtosis {logs.kurt():.2f},"
        f" skew {logs.skew():.2f}, lag-1 autocorrelation {logs.autocorr():.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aa-runs", type=int, default=100, help="A/A gate runs")
    parser.add_argument("--aa-max-blocks", type=int, default=12, help="most blocks per A/A run")
    parser.add_argument("--runs", type=int, default=10, help="gate runs per planted slowdown")
    parser.add_argument("--max-blocks", type=int, default=60, help="most blocks per planted run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block position")
    parser.add_argument("--record", type=int, default=200, help="blocks per harness abba recording")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        suite = tmp / "suite.toml"
        suite.write_text(SUITE)
        print(f"EP=2 on 2 ranks, {args.steps} steps per block position; gate at {1 + MAX_SLOWDOWN}")

        runs, old, logs = collect(suite, tmp, 0.0, args.aa_runs, args.aa_max_blocks, args.record, args.steps)
        print(f"A/A {describe_blocks(logs)}")
        covered = sum(r["low"] <= 1 <= r["high"] for r in runs) / len(runs)
        fails = share(runs, "fail")
        print(
            f"A/A, {len(runs)} runs of at most {args.aa_max_blocks} blocks: interval covers 1 in {covered:.1%},"
            f" gate fails {fails:.1%}, passes {share(runs, 'pass'):.1%}"
        )
        old_covered = sum(o[1] <= 1 <= o[2] for o in old) / len(old)
        old_fails = sum(o[0] == "fail" for o in old) / len(old)
        print(f"  the old Student-t, looked at after every block: covers 1 in {old_covered:.1%}, fails {old_fails:.1%}")

        print(f"\n{'planted':>8} {'B/A (all blocks)':>17} {'pass':>6} {'fail':>6} {'inconcl.':>9}"
              f" {'median blocks':>14} {'median s':>9}   old Student-t: pass/fail")  # fmt: skip
        for fraction in (0.0, 0.05, 0.10, 0.20):
            runs, old, logs = collect(suite, tmp, fraction, args.runs, args.max_blocks, args.record, args.steps)
            measured = math.exp(statistics.fmean(logs))
            old_pass = sum(o[0] == "pass" for o in old) / len(old)
            old_fail = sum(o[0] == "fail" for o in old) / len(old)
            print(
                f"{fraction:>8.0%} {measured:>17.3f} {share(runs, 'pass'):>6.0%} {share(runs, 'fail'):>6.0%}"
                f" {share(runs, 'inconclusive'):>9.0%} {statistics.median(r['blocks'] for r in runs):>14g}"
                f" {statistics.median(r['seconds'] for r in runs):>9.1f}   {old_pass:.0%}/{old_fail:.0%}"
            )


if __name__ == "__main__":
    main()
