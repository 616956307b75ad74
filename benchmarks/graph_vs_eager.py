"""Step time of graph chunking vs eager chunking (cpu-tiny, EP=2 in one process, C=2), ABBA.

Both trainers are built (and the graph arm traced) before timing starts; then blocks of
``--steps`` steps alternate A B B A between them, so machine drift cancels within each block.

    python benchmarks/graph_vs_eager.py [--blocks 6] [--steps 5]
"""

from __future__ import annotations

import argparse

from harness.abba import abba_step_time
from harness.reference.train import TrainConfig, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per measurement")
    parser.add_argument("--chunks", type=int, default=2)
    args = parser.parse_args()
    trainers = {name: Trainer(TrainConfig(ep=2, chunking=name, chunks=args.chunks)) for name in ("eager", "graph")}
    result = abba_step_time(trainers["eager"], trainers["graph"], blocks=args.blocks, steps=args.steps)
    print(f"step time, cpu-tiny EP=2 in-process, {args.chunks} chunks")
    print(result.summary("eager", "graph"))
    for trainer in trainers.values():
        trainer.close()


if __name__ == "__main__":
    main()
