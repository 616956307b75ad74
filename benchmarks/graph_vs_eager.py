"""Step time of graph chunking vs eager chunking (cpu-tiny, EP=2 in one process, C=2), ABBA.

Both trainers are built (and the graph arm traced) before timing starts; then blocks of
``--steps`` steps alternate A B B A between them, so machine drift cancels within each block.

    python benchmarks/graph_vs_eager.py [--blocks 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import itertools
import time

from harness.abba import measure_abba
from harness.reference.train import TrainConfig, Trainer


def timed_steps(trainer: Trainer, counter: itertools.count, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(next(counter))
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per measurement")
    parser.add_argument("--chunks", type=int, default=2)
    args = parser.parse_args()
    trainers = {name: Trainer(TrainConfig(ep=2, chunking=name, chunks=args.chunks)) for name in ("eager", "graph")}
    counters = {name: itertools.count() for name in trainers}
    for name in trainers:  # warm-up outside the measurement
        timed_steps(trainers[name], counters[name], 2)
    result = measure_abba(
        lambda: timed_steps(trainers["eager"], counters["eager"], args.steps),
        lambda: timed_steps(trainers["graph"], counters["graph"], args.steps),
        args.blocks,
    )
    print(f"step time, cpu-tiny EP=2 in-process, {args.chunks} chunks")
    print(result.summary("eager", "graph"))
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
