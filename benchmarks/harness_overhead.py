"""End-to-end wall time of `harness run` against a bare torchrun of the same training.

A: ``python -m torch.distributed.run --standalone`` of this file's minimal worker. B: ``harness
run`` of a one-arm suite. They run in ABBA blocks; the result is the paired ratio B/A with a
confidence interval. Both sides, like for like:

* start an interpreter, import torch and launch ``--ranks`` processes through torch's elastic
  agent, which rendezvous over c10d on localhost, as a user waits for them;
* train the same Trainer (``TrainConfig(ep=ranks)``, the suite's defaults: cpu-tiny, seed 42) for
  the same steps, one intra-op thread per rank, with the same CPU kernels: the bare ranks get the
  environment the harness gives its ranks under ``--cpu-isa`` (the AVX2 pin by default);
* end the same way: ``trainer.close()``, ``destroy_process_group()``, then ``os._exit(0)`` in
  every rank once its output is flushed (the harness's ranks skip the interpreter's teardown, so
  the bare ones do too, and the ratio does not count it).

Only in B, so what the ratio measures: suite validation, the environment description and the
manifest; in each rank, the death watch, stack-dump handler and error-file recorder, the phase
records, imports frozen out of the garbage collector (``gc.freeze``), a line per
step in its log, and the records (metrics, events and losses of every logical rank, logical rank
0's gradient and parameter digests every step, parameter hashes, final-weight hashes); the
launcher's watchdog and exit-recorder threads; and, after the ranks, the checks, summary, report
and junit.

    python benchmarks/harness_overhead.py [--blocks 3] [--steps 10] [--ranks 2] [--cpu-isa avx2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.abba import abba_order, paired_ratio
from harness.environment import CPU_ISAS, cpu_pin
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
    """What torchrun runs: the Trainer's step loop and nothing of the harness (one thread, as the
    harness's ranks)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    trainer = Trainer(TrainConfig(ep=ep))
    for step in range(1, steps + 1):
        trainer.step(step)
    trainer.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3, help="ABBA blocks (4 runs each)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2, help="processes, and the EP degree")
    parser.add_argument("--cpu-isa", choices=CPU_ISAS, default="avx2", help="the kernels both sides run")
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
        bare_env = {**os.environ, **cpu_pin(args.cpu_isa).env}  # what the harness exports to its ranks
        harness = [
            sys.executable, "-m", "harness", "run", str(suite), "--golden", "off", "--cpu-isa", args.cpu_isa, "--out",
        ]  # fmt: skip
        outs = (f"{tmp}/run{i}" for i in itertools.count())
        order = abba_order(args.blocks)
        values = [timed(torchrun, bare_env) if arm == "A" else timed([*harness, next(outs)]) for arm in order]
    result = paired_ratio(order, values, anytime=False)
    for arm, label in (("A", "bare torchrun"), ("B", "harness run")):
        times = [v for a, v in zip(order, values) if a == arm]
        print(
            f"{label:<14} median {statistics.median(times):6.2f} s over {len(times)} runs"
            f" ({args.ranks} ranks, {args.steps} steps)"
        )
    print(result.summary("bare torchrun", "harness run"))


if __name__ == "__main__":
    main()
