"""What a checkpoint costs: save and load time of the reference's checkpoint
(harness/reference/checkpoint.py, torch.distributed.checkpoint) and its size on disk against the
bytes of the model and AdamW state it holds, per model config, EP in one process.

Each round saves the trainer after a step into a fresh folder and loads it into a second trainer;
the times are the medians over ``--rounds``, beside the median step time of the same trainer, so
the cost reads as steps. Sizes: every file of the checkpoint against the bytes of every logical
rank's parameters, buffers and AdamW moments.

    python benchmarks/checkpoint.py [--rounds 5] [--models cpu-tiny cpu-tiny-64e]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from harness.reference import checkpoint
from harness.reference.train import TrainConfig, Trainer


def state_bytes(trainer: Trainer) -> int:
    """Parameters, buffers and AdamW's two moments and step of every logical rank of the trainer."""
    return sum(t.numel() * t.element_size() for t in checkpoint.state(trainer).values())


def measure(model: str, rounds: int) -> str:
    config = TrainConfig(model=model, ep=2, chunking="eager", chunks=2)
    trainer, other = Trainer(config), Trainer(config)
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
        f"{model}: save {save * 1e3:.1f} ms ({save / step:.2f} steps), load {load * 1e3:.1f} ms"
        f" ({load / step:.2f} steps); {on_disk / 2**20:.2f} MiB on disk for {held / 2**20:.2f} MiB of model"
        f" and AdamW state ({on_disk / held:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=["cpu-tiny", "cpu-tiny-64e"])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"EP=2 in one process, median of {args.rounds} rounds")
    for model in args.models:
        print(measure(model, args.rounds))


if __name__ == "__main__":
    main()
