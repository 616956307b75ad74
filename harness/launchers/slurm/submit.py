"""Submission: a run's launch groups queued as Slurm jobs through submitit, and cancelling them.

Each group becomes one job of ``nodes`` x ``ranks / nodes`` tasks, each task running
``run_task`` (slurm/task.py); the jobs are chained with ``afterany`` dependencies, so the groups
run one after another as they do locally, and all are queued at once (``--no-wait``).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

from harness.launchers.slurm.jobs import JOB_DIR, SlurmJob, write_jobs
from harness.launchers.slurm.profile import SlurmProfile, executor_parameters, job_shape
from harness.launchers.slurm.task import run_task
from harness.plan import LaunchGroup
from harness.suites import SuiteError


class SlurmError(Exception):
    """Slurm refused a submission or cannot be reached; an infrastructure failure (exit 3)."""


def require_slurm() -> None:
    """``harness submit`` needs Slurm's commands; without them nothing is created (exit 2)."""
    missing = [cmd for cmd in ("sbatch", "squeue", "scancel", "srun") if shutil.which(cmd) is None]
    if missing:
        raise SuiteError(f"harness submit: no Slurm here ({', '.join(missing)} not on PATH)")


def submit_jobs(
    run_dir: Path,
    suite_name: str,
    groups: list[LaunchGroup],
    profile: SlurmProfile,
    nodes: int,
    env: dict[str, str],
    source: dict[str, Any],
) -> list[SlurmJob]:
    """Queues one job per group, chained so they run in order, and writes ``slurm/jobs.json``.

    ``source`` says how to load the suite again (``harness collect``). A refused submission
    cancels what was queued and raises SlurmError.
    """
    import submitit

    folder = run_dir / JOB_DIR
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    jobs: list[SlurmJob] = []
    for group in groups:
        tasks_per_node = job_shape(group, nodes)
        after = jobs[-1].job_id if jobs else None
        executor.update_parameters(
            **executor_parameters(profile, f"harness-{suite_name}-{group.name}", nodes, tasks_per_node, after)
        )
        try:
            job = executor.submit(run_task, str(run_dir.resolve()), group.name, env)
        except Exception as e:
            cancel([j.job_id for j in jobs])
            raise SlurmError(f"sbatch refused the job of group '{group.name}': {str(e).strip()}") from None
        jobs.append(SlurmJob(group.name, str(job.job_id), nodes, tasks_per_node))
    write_jobs(run_dir, source, dataclasses.asdict(profile), jobs)
    return jobs


def cancel(job_ids: list[str], signal_name: str | None = None) -> None:
    """``scancel`` (or sends ``signal_name`` to every step of) the jobs; a finished job is no error."""
    if job_ids:
        flags = [f"--signal={signal_name}"] if signal_name else []
        subprocess.run(["scancel", *flags, *job_ids], capture_output=True, check=False)
