"""What training in lockstep with an oracle costs: step time of an oracle arm over the same arm
without it, for each oracle (Hugging Face, torchtitan, torchrec), ABBA, in one run.

Hugging Face and torchtitan: the arm is `fidelity`'s, cpu-tiny-learned, learned routing, eager
chunking C=2, EP=2 in one process. An oracle step gathers the reference's weights, loads them into
the oracle's model, runs its forward, backward and AdamW step, and records the differences of every
tensor (gradients, weights, AdamW's moments); the reference's own step is the plain arm's.

torchrec: the arm is `pec-torchrec`'s, a pipelined PEC table (``--pec-optimizer``) on cpu-tiny with
EP=2 on 2 gloo processes (torchrec runs one shard per process); its oracle step trains torchrec's
own PEC beside the table and compares every row (:mod:`harness.oracles.torchrec`). The ranks run in
lockstep through their collectives; process rank 0 reports the ratio. It needs torchrec
(``tools/install-torchrec``).

Every trainer is built before timing starts (a PEC trainer for more batches than the benchmark runs,
so every timed call is a steady-state one); blocks of ``--steps`` steps alternate A B B A (plain,
oracle), so machine drift cancels within each block, and each ratio comes with a 95% interval
(:mod:`harness.abba`).

    python benchmarks/oracle_cost.py [--blocks 4] [--steps 3] [--pec-optimizer rowwise-adagrad]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.abba import abba_step_time
from harness.oracles.hf import HuggingFace
from harness.oracles.lockstep import Lockstep
from harness.oracles.torchtitan import Torchtitan
from harness.reference.pec import PEC_OPTIMIZERS, PECConfig, PECTrainer
from harness.reference.train import TrainConfig, Trainer

CONFIG = TrainConfig(
    model="cpu-tiny-learned", ep=2, routing="learned", chunking="eager", chunks=2, local_batch=4, seq_len=32
)
ORACLES = {"hf": HuggingFace, "torchtitan": Torchtitan}
PEC_WORLD = 2
PEC_SHAPE = {"ep": PEC_WORLD, "routing": "forced-balanced", "local_batch": 4, "seq_len": 32, "pec": "pipelined"}


def _torchrec_rank(rank: int, store: str, args: argparse.Namespace) -> None:
    """One of the PEC arm's processes: the arm alone and with torchrec beside it, ABBA."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=PEC_WORLD)
    from harness.oracles.torchrec import TorchrecLockstep  # torchrec imported in the ranks only

    config = PECConfig(**PEC_SHAPE, pec_optimizer=args.pec_optimizer)
    batches = (args.blocks * 4 + 1) * args.steps + 2  # every measured call is a steady-state one
    alone, beside = PECTrainer(config, batches=batches), TorchrecLockstep(config, batches=batches)
    try:
        result = abba_step_time(alone, beside, blocks=args.blocks, steps=args.steps, first_step=1)
    finally:
        beside.close()
        alone.close()
        dist.destroy_process_group()
    if rank == 0:
        print(f"step time, cpu-tiny EP=2 on {PEC_WORLD} gloo processes, pipelined PEC table, {args.pec_optimizer}")
        print(f"oracle torchrec: {result.summary('plain', 'torchrec')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per measurement")
    parser.add_argument("--pec-optimizer", choices=PEC_OPTIMIZERS, default="rowwise-adagrad")
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
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _torchrec_rank, args=(os.path.join(tmp, "store"), args), nprocs=PEC_WORLD, start_method="spawn"
        )


if __name__ == "__main__":
    main()
