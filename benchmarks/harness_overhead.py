"""End-to-end wall time of `harness run` against a bare torchrun of the same training.

A: ``python -m torch.distributed.run --standalone`` of this file's minimal worker, which builds
the reference Trainer and runs the steps, nothing else. B: ``harness run`` of a one-arm suite
with the same config and steps (elastic launch, records, token-exchange invariants, summary,
report, junit). Both include interpreter and torch start-up, as a user waits for them. They run
in ABBA blocks; the result is the paired ratio B/A with a confidence interval.

    python benchmarks/harness_overhead.py [--blocks 3] [--steps 10] [--ranks 2]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from harness.abba import abba_order, paired_ratio
from harness.reference.train import TrainConfig, Trainer

SUITE = """
name = "overhead"
description = "one arm, for benchmarks/harness_overhead.py"
ranks = {ranks}
steps = {steps}
[arms.only]
[[checks]]
kind = "token-exchange-invariants"
"""


def bare_worker(steps: int, ep: int) -> None:
    """What torchrun runs: the Trainer's step loop and nothing of the harness."""
    dist.init_process_group("gloo")
    trainer = Trainer(TrainConfig(ep=ep))
    for step in range(1, steps + 1):
        trainer.step(step)
    trainer.close()
    dist.destroy_process_group()


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="ABBA blocks (4 runs each)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2, help="processes, and the EP degree")
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:
        bare_worker(args.steps, args.ranks)
        return
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp) / "overhead.toml"
        suite.write_text(SUITE.format(ranks=args.ranks, steps=args.steps))
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
            __file__, "--bare-worker", f"--steps={args.steps}", f"--ranks={args.ranks}",
        ]  # fmt: skip
        harness = [sys.executable, "-m", "harness", "run", str(suite), "--golden", "off", "--out"]
        outs = (f"{tmp}/run{i}" for i in itertools.count())
        order = abba_order(args.blocks)
        values = [timed(torchrun if arm == "A" else [*harness, next(outs)]) for arm in order]
    result = paired_ratio(order, values)
    for arm, label in (("A", "bare torchrun"), ("B", "harness run")):
        times = [v for a, v in zip(order, values) if a == arm]
        print(
            f"{label:<14} median {statistics.median(times):6.2f} s over {len(times)} runs"
            f" ({args.ranks} ranks, {args.steps} steps)"
        )
    print(result.summary("bare torchrun", "harness run"))


if __name__ == "__main__":
    main()
