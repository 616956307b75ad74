"""A rank's process: tied to the harness's life, logging in order, and joined to its process group.

A rank must never outlive the harness that launched it, even one killed by SIGKILL (no orphans
holding a GPU or a port): the launchers export their pid as ``AGENT_PID_ENV``, and the rank asks
the kernel to kill it when that parent dies (:func:`set_up_process`). On CUDA it drives one GPU,
chosen by :func:`cuda_device_index`, with deterministic kernels: exact comparisons are the point of
the harness.

The launchers import ``AGENT_PID_ENV`` from here, at no cost: they import torch.distributed anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist

# The harness process (the elastic agent) exports its pid, so a rank can tell it was orphaned.
AGENT_PID_ENV = "HARNESS_AGENT_PID"
_PR_SET_PDEATHSIG = 1


def set_up_process() -> None:
    """Readies the rank's process once its imports are done: their objects frozen, stderr joined to
    stdout, the rank tied to the harness's life, and its stacks dumped on SIGUSR1."""
    # The imports made a few hundred thousand objects that live as long as the rank; frozen, they
    # are no longer walked by every full collection while the arms trace and train.
    gc.freeze()
    os.dup2(1, 2)  # stderr joins stdout in logs/rank<k>.log, in order
    sys.stdout.reconfigure(line_buffering=True)
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog's stack dump (launchers/deadline.py)


def _die_with_parent() -> None:
    """Ask the kernel to kill this rank if the harness dies, even by SIGKILL: no orphans."""
    if sys.platform == "linux":
        ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ[AGENT_PID_ENV]):  # the harness died before we asked
        os._exit(1)


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The GPU a rank drives: its local rank among the GPUs it sees, or the only one it sees where the
    cluster gives each task its own (Slurm's per-task CUDA_VISIBLE_DEVICES). Anything else is one
    line naming the rank's LOCAL_RANK and what it sees."""
    if visible < 1:
        raise RuntimeError(f"LOCAL_RANK {local_rank}: no GPU visible (CUDA_VISIBLE_DEVICES)")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK {local_rank}: only {visible} GPUs visible (CUDA_VISIBLE_DEVICES)")
    return local_rank


def init_process_group(device: str, backend: str) -> None:
    """Joins the launch group's process group (the launcher's rendezvous environment), on CPU with one
    thread, on CUDA on this rank's GPU with deterministic kernels."""
    torch.set_num_threads(1)
    if device == "cuda":
        # Deterministic cuBLAS and kernels: exact comparisons are the point of the harness.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        index = cuda_device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count())
        torch.cuda.set_device(index)  # the subject builds on torch.cuda.current_device()
        dist.init_process_group(backend, device_id=torch.device("cuda", index))
    else:
        dist.init_process_group(backend)
