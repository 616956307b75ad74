"""Versioned pipeline costs: delay 0 vs delay 2, retain vs offload vs replay; stale-vs-strict band.

**Cost.** Four setups of the versioned trainer (EP=2 in one process, eager chunking C=2) run side
by side in rotating order (ABCD, DCBA, ...), each round in fresh subprocesses, so drift on a
shared machine hits all of them alike. A subprocess builds the trainer and trains ``--steps``
batches twice (fill and drain included, so every setup does the same forwards and backwards):

* peak memory, over the first run: growth of the process's peak resident set size over its
  resident size once the trainer is built (Linux: the peak is reset through
  ``/proc/self/clear_refs``). On CPU this is every byte training touched: retained forward state
  (activations and weight snapshots), gradients, optimizer state and allocator slack alike; only
  the retained state differs between the setups;
* throughput, over the second (warm) run: tokens per second of wall time.

Ratios are per round against a baseline setup, summarised as a geometric mean with a 95%
Student-t interval over the rounds.
On CPU, ``offload`` is a host-to-host copy, once per saved tensor: it costs time and memory and
saves nothing, by construction; its memory benefit exists only on an accelerator.

**Band.** Strict (delay 0) and stale (delay 2, max staleness 2) runs of the suite-sized config,
per correction policy and seed, compared update by update: relative deviation of loss and grad
norm (max and final), and the Pearson correlation of the two trajectories.

    python benchmarks/staleness.py [--rounds 4] [--steps 12] [--band-steps 20] [--seeds 42 43 44]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scipy import stats

from harness.reference.pipeline import PipelineConfig, VersionedTrainer

# Large enough that activations, not the interpreter, dominate the memory growth.
COST_BASE = {"ep": 2, "chunking": "eager", "chunks": 2, "local_batch": 16, "seq_len": 128}
SETUPS = {
    "delay 0 retain": {"delay": 0, "retention": "retain"},
    "delay 2 retain": {"delay": 2, "retention": "retain"},
    "delay 2 offload": {"delay": 2, "retention": "offload"},
    "delay 2 replay": {"delay": 2, "retention": "replay"},
}
COMPARISONS = [
    ("delay 2 retain", "delay 0 retain"),
    ("delay 2 offload", "delay 2 retain"),
    ("delay 2 replay", "delay 2 retain"),
]
# The strict-vs-stale suite's shape.
BAND_BASE = {"ep": 2, "chunking": "eager", "chunks": 2, "local_batch": 4, "seq_len": 32}


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(config: PipelineConfig, steps: int) -> dict:
    """Runs inside a fresh subprocess: peak memory growth of a first run, throughput of a second."""
    trainer = VersionedTrainer(config)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
        base = _kib("VmRSS")
        list(trainer.run(steps))
        peak_growth = (_kib("VmHWM") - base) / 1024
        start = time.perf_counter()
        tokens = sum(record["tokens"] for record in trainer.run(steps))
        return {"tokens_per_s": tokens / (time.perf_counter() - start), "peak_growth_mib": peak_growth}
    finally:
        trainer.close()


def run_setup(name: str, steps: int) -> dict:
    config = {**COST_BASE, **SETUPS[name]}
    cmd = [sys.executable, __file__, "--child", json.dumps(config), "--steps", str(steps)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def interval(log_ratios: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Geometric mean of the per-round ratios and its Student-t interval (n - 1 degrees of freedom:
    with 4 rounds the 95% quantile is 3.18, not the normal 1.96)."""
    low, high = stats.ttest_1samp(log_ratios, 0.0).confidence_interval(confidence)
    return math.exp(statistics.fmean(log_ratios)), math.exp(low), math.exp(high)


def cost(rounds: int, steps: int) -> None:
    names = list(SETUPS)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(run_setup(name, steps))
    print(f"cost: {COST_BASE}, {steps} batches per run, {rounds} rounds")
    print(f"{'setup':<16} {'tokens/s':>10} {'peak growth MiB':>16}")
    for name in names:
        tps = statistics.median(r["tokens_per_s"] for r in results[name])
        mem = statistics.median(r["peak_growth_mib"] for r in results[name])
        print(f"{name:<16} {tps:>10.0f} {mem:>16.1f}")
    print(f"\n{'ratio':<36} {'throughput':>10}  95% interval        {'peak memory':>11}  95% interval")
    for setup, base in COMPARISONS:
        row = f"{setup + ' / ' + base:<36}"
        for key in ("tokens_per_s", "peak_growth_mib"):
            logs = [math.log(a[key] / b[key]) for a, b in zip(results[setup], results[base])]
            ratio, low, high = interval(logs)
            row += f" {ratio:>10.3f}  [{low:.3f}, {high:.3f}]"
        print(row)


def trajectory(config: PipelineConfig, steps: int) -> tuple[list[float], list[float], list[float | None]]:
    trainer = VersionedTrainer(config)
    try:
        records = list(trainer.run(steps))
    finally:
        trainer.close()
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], [r["correction_mean"] for r in records]


def deviation(strict: list[float], stale: list[float]) -> tuple[float, float, float]:
    """Max and final relative deviation of ``stale`` from ``strict``, and their correlation."""
    rel = [abs(b - a) / abs(a) for a, b in zip(strict, stale)]
    return max(rel), rel[-1], statistics.correlation(strict, stale)


def band(steps: int, seeds: list[int]) -> None:
    print(f"\nband: {BAND_BASE}, {steps} updates, strict = delay 0, stale = delay 2 (max staleness 2)")
    print(
        f"{'correction':<15} {'seed':>4}  {'loss max rel':>12} {'final rel':>10} {'corr':>7}  "
        f"{'gnorm max rel':>13} {'final rel':>10} {'corr':>7}  {'mean w':>7}"
    )
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for correction in ("off", "when_available", "always"):
        for seed in seeds:
            strict = trajectory(PipelineConfig(**BAND_BASE, seed=seed, delay=0, correction=correction), steps)
            stale = trajectory(PipelineConfig(**BAND_BASE, seed=seed, delay=2, correction=correction), steps)
            loss, gnorm = deviation(strict[0], stale[0]), deviation(strict[1], stale[1])
            worst["loss"] = max(worst["loss"], loss[0])
            worst["grad_norm"] = max(worst["grad_norm"], gnorm[0])
            weights = [w for w in stale[2] if w is not None]
            mean_w = f"{statistics.fmean(weights):.4f}" if weights else "-"
            print(
                f"{correction:<15} {seed:>4}  {loss[0]:>12.2e} {loss[1]:>10.2e} {loss[2]:>7.4f}  "
                f"{gnorm[0]:>13.2e} {gnorm[1]:>10.2e} {gnorm[2]:>7.4f}  {mean_w:>7}"
            )
    print(f"worst max rel deviation: loss {worst['loss']:.3e}, grad_norm {worst['grad_norm']:.3e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="batches per cost run")
    parser.add_argument("--band-steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds: an interval needs at least 2 rounds")
    if args.child:
        print(json.dumps(measure(PipelineConfig(**json.loads(args.child)), args.steps)))
        return
    if not args.skip_cost:
        cost(args.rounds, args.steps)
    band(args.band_steps, args.seeds)


if __name__ == "__main__":
    main()
