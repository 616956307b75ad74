"""Step time under the portable AVX2 kernel pin vs native CPU kernels, ABBA.

The pin must be in place before torch loads, so each side is its own long-lived process
(``--worker``) holding one Trainer: one started with the harness's pin environment, one without.
The parent asks them in turn for blocks of ``--steps`` timed steps, A B B A, so machine drift
cancels within each block, and reports the paired ratio pinned / native.

    python benchmarks/cpu_isa.py [--blocks 6] [--steps 5] [--batch 16] [--seq 128]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time

from harness.abba import measure_abba
from harness.environment import cpu_pin


def worker(batch: int, seq: int) -> None:
    """Answers each line on stdin (a step count) with the mean seconds per step."""
    import torch

    from harness.reference.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    trainer = Trainer(TrainConfig(ep=2, local_batch=batch, seq_len=seq))
    counter = itertools.count(1)
    print(torch.backends.cpu.get_cpu_capability(), flush=True)
    for line in sys.stdin:
        steps = int(line)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step(next(counter))
        print((time.perf_counter() - start) / steps, flush=True)
    trainer.close()


class Side:
    """One worker process and the kernels it reported."""

    def __init__(self, env: dict[str, str], batch: int, seq: int) -> None:
        command = [sys.executable, __file__, "--worker", f"--batch={batch}", f"--seq={seq}"]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
        )
        self.capability = self.proc.stdout.readline().strip()

    def time(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per measurement")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.batch, args.seq)
        return
    pin = cpu_pin("avx2")
    if not pin.pinned:
        sys.exit(f"nothing to compare: {pin.note}")
    native = Side({}, args.batch, args.seq)
    pinned = Side(pin.env, args.batch, args.seq)
    for side in (native, pinned):
        side.time(2)  # warm-up outside the measurement
    result = measure_abba(lambda: native.time(args.steps), lambda: pinned.time(args.steps), args.blocks)
    print(f"step time, cpu-tiny EP=2 in one process, batch {args.batch}x{args.seq}")
    print(result.summary(f"native ({native.capability})", f"pinned ({pinned.capability})"))
    for side in (native, pinned):
        side.close()


if __name__ == "__main__":
    main()
