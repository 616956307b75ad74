"""One rank of a launch group: ``python -m harness.worker RUN_DIR GROUP``, started by launch.py.

Runs each arm of the group in turn, re-seeded identically, and streams what the parent
compares: ``arms/<arm>/metrics.jsonl`` (process rank 0) and
``arms/<arm>/events.rank<logical rank>.jsonl`` (the process hosting that logical rank). Every
line is flushed, so a crash leaves every finished step on disk.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from harness.records import JsonlWriter, write_json_atomic
from harness.reference.train import TrainConfig, Trainer

_PR_SET_PDEATHSIG = 1
# The harness process (the elastic agent) exports its pid, so a rank can tell it was orphaned.
AGENT_PID_ENV = "HARNESS_AGENT_PID"
# Exit code of an injected `fail_mode = "exit"`, recognisable in the parent's message.
INJECTED_EXIT_CODE = 13


def _die_with_parent() -> None:
    """Ask the kernel to kill this rank if the harness dies, even by SIGKILL: no orphans."""
    if sys.platform == "linux":
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[AGENT_PID_ENV]):  # the harness died before we asked
        os._exit(1)


def _init_process_group(device: str, backend: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        # Deterministic cuBLAS and kernels: exact comparisons are the point of the harness.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend)


def _inject_fault(debug: dict[str, Any], arm: str, step: int, rank: int) -> None:
    """The [debug] table: make this rank raise, exit or hang, to prove the failure paths."""
    if (debug["fail_step"], debug["fail_arm"], debug["fail_rank"]) != (step, arm, rank):
        return
    mode = debug["fail_mode"]
    print(f"[debug] injecting fail_mode={mode} on rank {rank}, arm {arm}, step {step}", flush=True)
    if mode == "raise":
        raise RuntimeError(f"injected failure (debug.fail_mode = 'raise') on rank {rank}, arm {arm}, step {step}")
    if mode == "exit":
        os._exit(INJECTED_EXIT_CODE)
    while True:  # "hang": sleep in Python so the stack dump shows where
        time.sleep(1)


def run_arm(run_dir: Path, arm: str, train: dict[str, Any], steps: int, debug: dict[str, Any]) -> None:
    """Builds the arm's Trainer from a fresh seed and runs its steps, streaming records."""
    rank = dist.get_rank()
    arm_dir = run_dir / "arms" / arm
    config = TrainConfig(**train)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    with contextlib.ExitStack() as stack:
        writers: dict[int, JsonlWriter] = {}
        opening = threading.Lock()

        def sink(logical_rank: int, event: dict) -> None:
            # Called from each logical rank's thread; each file has one writer thread.
            if logical_rank not in writers:
                with opening:
                    path = arm_dir / f"events.rank{logical_rank}.jsonl"
                    writers[logical_rank] = stack.enter_context(JsonlWriter(path))
            writers[logical_rank].write(event)

        trainer = Trainer(config, event_sink=sink)
        stack.callback(trainer.close)
        metrics = stack.enter_context(JsonlWriter(arm_dir / "metrics.jsonl")) if rank == 0 else None
        if rank == 0:
            write_json_atomic(arm_dir / "arm.json", {"moe_layers": list(trainer.moe_layers), "train": train})
        for step in range(1, steps + 1):
            _inject_fault(debug, arm, step, rank)
            result = trainer.step(step)
            if metrics is not None:
                metrics.write(result)
            print(f"[arm {arm}] step {step}/{steps} loss={result['loss']!r} grad_norm={result['grad_norm']!r}", flush=True)


@record
def main(argv: list[str]) -> None:
    os.dup2(1, 2)  # stderr joins stdout in logs/rank<k>.log, in order
    sys.stdout.reconfigure(line_buffering=True)
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog's stack dump
    run_dir, group_name = Path(argv[0]), argv[1]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    group = next(g for g in manifest["launches"] if g["name"] == group_name)
    suite = manifest["suite"]
    _init_process_group(manifest["device"], manifest["backend"])
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} of group {group_name}: pid {os.getpid()}", flush=True)
    for arm in group["arms"]:
        run_arm(run_dir, arm, suite["arms"][arm]["train"], suite["steps"], suite["debug"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
