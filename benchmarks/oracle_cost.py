"""What the torchrec oracle costs: step time of a pipelined PEC arm with torchrec's own PEC beside its
table (``oracle = "torchrec"``) over the same arm without it, on 2 gloo processes (cpu-tiny, EP=2).

Each process builds both trainers before timing starts, each for more batches than the benchmark
runs, so every timed call is a steady-state one (no drain). Blocks of ``--steps`` steps then
alternate A B B A between them in the same processes, so machine drift cancels within each block;
the ratio is with-oracle / without with a 95% interval (:mod:`harness.abba`), as process rank 0
measured it (the ranks run in lockstep through their collectives). Needs torchrec
(``tools/install-torchrec``).

    python benchmarks/oracle_cost.py [--blocks 6] [--steps 5] [--optimizer rowwise-adagrad]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.abba import abba_step_time
from harness.reference.pec import PEC_OPTIMIZERS, PECConfig, PECTrainer

WORLD = 2
SHAPE = {"ep": WORLD, "local_batch": 4, "seq_len": 32, "pec": "pipelined"}


def _rank(rank: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    from harness.oracles.torchrec import TorchrecLockstep  # torchrec imported in the ranks only

    config = PECConfig(**SHAPE, pec_optimizer=args.optimizer)
    batches = (args.blocks * 4 + 1) * args.steps + 2  # every measured call is a steady-state one
    alone, beside = PECTrainer(config, batches=batches), TorchrecLockstep(config, batches=batches)
    try:
        result = abba_step_time(alone, beside, blocks=args.blocks, steps=args.steps, first_step=1)
    finally:
        beside.close()
        alone.close()
        dist.destroy_process_group()
    if rank == 0:
        print(f"step time, cpu-tiny EP=2 on {WORLD} gloo processes, pipelined PEC, {args.optimizer}")
        print(result.summary("without the oracle", "with torchrec's PEC beside it"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="steps per measurement")
    parser.add_argument("--optimizer", choices=PEC_OPTIMIZERS, default="rowwise-adagrad")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_rank, args=(store, args), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
