"""What training in lockstep with an oracle costs: step time of an oracle arm over the same arm
without it, for each oracle (Hugging Face, torchtitan), ABBA, in one run.

The arm is `fidelity`'s: cpu-tiny-learned, learned routing, eager chunking C=2, EP=2 in one process.
An oracle step gathers the reference's weights, loads them into the oracle's model, runs its forward,
backward and AdamW step, and records the differences of every tensor (gradients, weights, AdamW's
moments); the reference's own step is the plain arm's. Every trainer is built before timing starts;
blocks of ``--steps`` steps alternate A B B A (plain, oracle), so machine drift cancels within each
block, and each ratio comes with a 95% interval (:mod:`harness.abba`).

    python benchmarks/oracle_cost.py [--blocks 4] [--steps 3]
"""

from __future__ import annotations

import argparse

from harness.abba import abba_step_time
from harness.oracles.hf import HuggingFace
from harness.oracles.lockstep import Lockstep
from harness.oracles.torchtitan import Torchtitan
from harness.reference.train import TrainConfig, Trainer

CONFIG = TrainConfig(
    model="cpu-tiny-learned", ep=2, routing="learned", chunking="eager", chunks=2, local_batch=4, seq_len=32
)
ORACLES = {"hf": HuggingFace, "torchtitan": Torchtitan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per measurement")
    args = parser.parse_args()
    plain = Trainer(CONFIG)
    lines = []
    for name, counterpart in ORACLES.items():
        oracle = Lockstep(CONFIG, counterpart, event_sink=None, fidelity_sink=lambda line: None)
        result = abba_step_time(plain, oracle, blocks=args.blocks, steps=args.steps, first_step=1)
        lines.append(f"oracle {name}: {result.summary('plain', name)}")
        oracle.close()
    plain.close()
    print(f"step time, {CONFIG.model} EP=2 in one process, learned routing, eager chunking C=2")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
