"""Train ``cpu-tiny`` with expert parallelism and print one JSON line per step.

python -m harness.reference --ep 2 --ranks 2 --steps 5
python -m harness.reference --ep 2 --ranks 1 --steps 5   # same output, bit for bit
python -m harness.reference --ep 2 --steps 5 --chunks 2 --chunking graph   # = --chunking eager
"""

from __future__ import annotations

import argparse

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from harness.reference.train import CHUNKINGS, ROUTINGS, TrainConfig, print_trajectory


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=2, help="logical expert-parallel degree")
    parser.add_argument("--ranks", type=int, default=None, help="processes hosting the EP group (default: ep)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=1, help="chunk the MoE layers into this many chunks")
    parser.add_argument("--chunking", choices=CHUNKINGS, help="how to chunk (default: eager when --chunks > 1)")
    parser.add_argument("--routing", choices=ROUTINGS, default="forced-balanced")
    parser.add_argument("--model", default="cpu-tiny")
    parser.add_argument("--timing", action="store_true", help="add step_time_s to every line")
    args = parser.parse_args()
    ranks = args.ranks or args.ep
    if args.ep % ranks:
        parser.error(f"--ranks {ranks} must divide --ep {args.ep}")
    config = TrainConfig(
        model=args.model,
        ep=args.ep,
        routing=args.routing,
        chunking=args.chunking or ("eager" if args.chunks > 1 else "none"),
        chunks=args.chunks,
    )
    if ranks == 1:
        print_trajectory(config, args.steps, args.timing)
        return
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=ranks, rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0
    )
    elastic_launch(launch, print_trajectory)(config, args.steps, args.timing)


if __name__ == "__main__":
    main()
