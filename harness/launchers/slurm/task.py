"""Inside a Slurm job: one task, one rank of its launch group, run by the same rank process as a local launch.

``run_task`` is what submitit runs in each task. It exports torch.distributed's environment from
Slurm's (``submitit.helpers.TorchDistributedEnvironment``: MASTER_ADDR is the first node of the
job's node list, RANK the task's global rank), so one rendezvous spans every node, and runs
``python -m harness.rank RUN_DIR GROUP``, its output in the same ``logs/rank<k>.log`` and its
traceback in the same ``rank<k>.error.json`` as under the elastic agent. How the worker ended, or
the task's own traceback if it raised, goes to the task's ``slurm/<job>_<task>_result.json``
(slurm/jobs.py), the one thing of a task the watch reads.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from harness.launchers.slurm.jobs import result_file, write_result
from harness.manifest import Manifest
from harness.rank.errors import release_error_room
from harness.rank.process import AGENT_PID_ENV

# Rendezvous ports are drawn from here up to the kernel's ephemeral range (the default's start if unreadable).
_FIRST_RENDEZVOUS_PORT = 20000
_EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def rendezvous_port(job_id: str) -> int:
    """The job's MASTER_PORT, the same in every task: drawn from the job id, as submitit draws it, but
    below the ephemeral range. submitit's range (20000-60000) overlaps it, and a port that a
    connection on the first node happens to hold fails rank 0's store with EADDRINUSE."""
    try:
        first_ephemeral = int(_EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    return random.Random(job_id).randrange(_FIRST_RENDEZVOUS_PORT, max(first_ephemeral, _FIRST_RENDEZVOUS_PORT + 1))


def rendezvous_env() -> dict[str, str]:
    """torch.distributed's environment for this task, from Slurm's: MASTER_ADDR (the first node of
    the job), MASTER_PORT (:func:`rendezvous_port`), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE.
    CUDA_VISIBLE_DEVICES stays as Slurm set it: the rank picks its GPU by LOCAL_RANK."""
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    os.environ.setdefault("MASTER_PORT", str(rendezvous_port(JobEnvironment().job_id)))  # an explicit one wins
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {key: os.environ[key] for key in keys}


def run_task(run_dir: str, group_name: str, env: dict[str, str]) -> dict[str, Any]:
    """One task of a group's job: rank RANK of the group, run by the same rank process as a local launch.

    Writes how the worker ended to the task's ``result.json`` (atomically), and returns it; if the task
    itself raised, the result holds its traceback instead. The watch reads that JSON: submitit's
    result pickle is never loaded outside the job.
    """
    from submitit import JobEnvironment

    job = JobEnvironment()
    result_path = result_file(Path(run_dir), job.job_id, job.global_rank)
    result_path.unlink(missing_ok=True)  # a requeued job starts clean
    try:
        result = _run_worker(run_dir, group_name, env)
    except Exception:
        write_result(result_path, {"rank": job.global_rank, "exitcode": 1, "traceback": traceback.format_exc()})
        raise
    write_result(result_path, result)
    return result


def _run_worker(run_dir: str, group_name: str, env: dict[str, str]) -> dict[str, Any]:
    """The worker of this task's rank, to its end; its output goes to the group's ``rank<k>.log`` and a
    traceback to ``rank<k>.error.json``, as under the elastic agent. The task ignores SIGUSR1, the
    stack dump the watch sends to every process of the job at --timeout."""
    rendezvous = rendezvous_env()
    rank = int(rendezvous["RANK"])
    group = Manifest.read(run_dir).launch(group_name)
    log = Path(run_dir) / group.log(rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    errors = Path(run_dir) / group.error_file(rank)
    errors.unlink(missing_ok=True)  # a requeued job starts clean
    worker_env = {**os.environ, **env, AGENT_PID_ENV: str(os.getpid()), "TORCHELASTIC_ERROR_FILE": str(errors)}
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the worker installs its own stack-dump handler
    with log.open("ab") as out:
        command = [sys.executable, "-m", "harness.rank", run_dir, group_name]
        worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=worker_env)
    exitcode = worker.wait()
    release_error_room(errors)
    return {"rank": rank, "pid": worker.pid, "exitcode": exitcode, "died_at": time.time(), "host": socket.gethostname()}
