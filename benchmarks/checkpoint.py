"""What a checkpoint costs: save and load time of the reference's checkpoint
(harness/reference/checkpoint.py, torch.distributed.checkpoint) and its size on disk against the
bytes of the state it holds, per trainer and model config, EP in one process.

Each round trains a step, saves the trainer into a fresh folder and loads it into a second trainer;
the times are the medians over ``--rounds``, beside the median step time of the same trainer, so
the cost reads as steps. Sizes: every file of the checkpoint against the bytes of every logical
rank's parameters, buffers and AdamW moments, and what the trainer holds in flight. Trainers:
``plain`` (eager chunking C=2); ``versioned`` (delay 2, correction always: two forwards pending,
their snapshots and recipes); ``pec`` (pipelined: a NOL gradient part pending, the row-wise state).

    python benchmarks/checkpoint.py [--rounds 5] [--models cpu-tiny cpu-tiny-64e] [--trainers plain versioned pec]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from harness.reference import checkpoint
from harness.reference.pec import PECConfig, PECTrainer
from harness.reference.pipeline import PipelineConfig, VersionedTrainer
from harness.reference.train import TrainConfig, Trainer

# Trainer name -> a trainer of a model config, good for ``rounds`` steps.
TRAINERS: dict[str, Callable[[str, int], Trainer]] = {
    "plain": lambda model, rounds: Trainer(TrainConfig(model=model, ep=2, chunking="eager", chunks=2)),
    "versioned": lambda model, rounds: VersionedTrainer(
        PipelineConfig(model=model, ep=2, chunking="eager", chunks=2, delay=2, correction="always")
    ),
    # One batch more than the rounds: the last one, which drains, never runs, so every save has a NOL part pending.
    "pec": lambda model, rounds: PECTrainer(
        PECConfig(model=model, ep=2, chunking="eager", chunks=2), batches=rounds + 1
    ),
}


def state_bytes(trainer: Trainer) -> int:
    """Parameters, buffers, AdamW's moments and step of every logical rank, and the work in flight."""
    held = checkpoint.state(trainer) | checkpoint.in_flight(trainer)
    return sum(t.numel() * t.element_size() for t in held.values())


def measure(kind: str, model: str, rounds: int) -> str:
    trainer, other = TRAINERS[kind](model, rounds), TRAINERS[kind](model, rounds)
    saves, loads, steps = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, rounds + 1):
            start = time.perf_counter()
            trainer.step(round_)
            steps.append(time.perf_counter() - start)
            folder = Path(tmp) / f"round{round_}"
            start = time.perf_counter()
            saved = checkpoint.save(trainer, round_, folder)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoint.load(other, folder, round_)
            loads.append(time.perf_counter() - start)
        on_disk = sum(p.stat().st_size for p in saved.iterdir())
    held = state_bytes(trainer)
    trainer.close()
    other.close()
    step, save, load = (statistics.median(x) for x in (steps, saves, loads))
    return (
        f"{kind} {model}: save {save * 1e3:.1f} ms ({save / step:.2f} steps), load {load * 1e3:.1f} ms"
        f" ({load / step:.2f} steps); {on_disk / 2**20:.2f} MiB on disk for {held / 2**20:.2f} MiB of state"
        f" ({on_disk / held:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["cpu-tiny", "cpu-tiny-64e"])
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=list(TRAINERS))
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"EP=2 in one process, median of {args.rounds} rounds")
    for kind in args.trainers:
        for model in args.models:
            print(measure(kind, model, args.rounds))


if __name__ == "__main__":
    main()
