"""The [debug] table's planted failures (:class:`~harness.specs.DebugSpec`), which prove the harness's
failure paths on a healthy subject: a rank that raises, exits, hangs or dies by SIGKILL at a chosen
step, every rank stopping an arm early without an error, and a checkpoint damaged before a resumed
arm loads it. A suite without a [debug] table plants nothing; a throughput run's planted slowdown
is its timed arm's own (throughput.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist

from harness.specs import DebugSpec

# Exit code of an injected `fail_mode = "exit"`, recognisable in the parent's message.
INJECTED_EXIT_CODE = 13


def inject_fault(debug: DebugSpec, arm: str, step: int, rank: int) -> bool:
    """Before ``step`` of ``arm``: make this rank raise, exit, hang or die by SIGKILL, or every rank stop
    the arm early without an error (as a trainer whose loop ends early). Returns whether the arm goes on."""
    mode = debug.fail_mode
    if (debug.fail_step, debug.fail_arm) != (step, arm) or (mode != "stop" and debug.fail_rank != rank):
        return True
    print(f"[debug] injecting fail_mode={mode} on rank {rank}, arm {arm}, step {step}", flush=True)
    if mode == "stop":
        return False
    if mode == "raise":
        raise RuntimeError(f"injected failure (debug.fail_mode = 'raise') on rank {rank}, arm {arm}, step {step}")
    if mode == "exit":
        os._exit(INJECTED_EXIT_CODE)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # "hang": sleep in Python so the stack dump shows where
        time.sleep(1)


def damage_checkpoint(folder: Path, how: str, rank: int) -> None:
    """The [debug] table's ``checkpoint_damage``, done by process rank 0 before a resumed arm's load,
    then a barrier: a shard (torch.distributed.checkpoint's ``*.distcp``, the last by name) removed
    or cut to half its size, the index (``.metadata``) overwritten with bytes that are no pickle, or
    the manifest (the reference's ``harness.json``) made to record another seed, as a checkpoint of
    another config would."""
    if rank == 0:
        print(f"[debug] damaging the checkpoint under {folder}: {how}", flush=True)
        shard = sorted(folder.rglob("*.distcp"))[-1]
        if how == "missing-shard":
            shard.unlink()
        elif how == "truncated-shard":
            os.truncate(shard, shard.stat().st_size // 2)
        elif how == "garbage-index":
            next(folder.rglob(".metadata")).write_bytes(b"garbage, not a pickle\n" * 8)
        else:
            manifest = next(folder.rglob("harness.json"))
            saved = json.loads(manifest.read_text())
            saved["config"]["seed"] += 1
            manifest.write_text(json.dumps(saved))
    dist.barrier()
