"""Step time of the pipelined PEC trainer vs the sequential one (cpu-tiny, EP=2 in one process), ABBA;
and the gradient all-to-alls each progress call starts.

Both trainers are built before timing starts, each for more batches than the benchmark runs, so
every timed call is a steady-state one (no drain). Blocks of ``--steps`` steps then alternate
A B B A between them, so machine drift cancels within each block; the ratio is pipelined /
sequential with a 95% interval (:mod:`harness.abba`). The counts come from the trainers' own PEC
events (each start is one OL or NOL gradient all-to-all of one logical rank), over a separate short
run of ``--count-batches`` batches that fills and drains.

    python benchmarks/pec.py [--blocks 6] [--steps 5] [--count-batches 5]
"""

from __future__ import annotations

import argparse
from collections import Counter

from harness.abba import abba_step_time
from harness.reference.pec import PECConfig, PECTrainer

TRAINERS = ("sequential", "pipelined")
SHAPE = {"ep": 2, "local_batch": 4, "seq_len": 32}


def starts_per_call(pec: str, batches: int) -> list[int]:
    """Gradient all-to-all starts of logical rank 0 in each progress call of a ``batches``-batch run."""
    starts: Counter = Counter()

    def count(rank: int, event: dict) -> None:
        if rank == 0 and event["op"] == "start":
            starts[event["call"]] += 1

    trainer = PECTrainer(PECConfig(**SHAPE, pec=pec), pec_sink=count, batches=batches)
    try:
        for step in range(1, batches + 1):
            trainer.step(step)
    finally:
        trainer.close()
    return [starts[call] for call in range(1, batches + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per measurement")
    parser.add_argument("--count-batches", type=int, default=5, help="batches of the run that counts all-to-alls")
    args = parser.parse_args()
    for pec in TRAINERS:
        counts = starts_per_call(pec, args.count_batches)
        print(f"{pec}: gradient all-to-all starts per call (logical rank 0): {counts}, {sum(counts)} in all")
    batches = (args.blocks * 4 + 1) * args.steps + 2  # every measured call is a steady-state one
    trainers = {pec: PECTrainer(PECConfig(**SHAPE, pec=pec), batches=batches) for pec in TRAINERS}
    result = abba_step_time(
        trainers["sequential"], trainers["pipelined"], blocks=args.blocks, steps=args.steps, first_step=1
    )
    print(f"step time, cpu-tiny EP=2 in-process, PEC token embedding ({SHAPE})")
    print(result.summary("sequential", "pipelined"))
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
