"""A submitted run's Slurm jobs as files, in the run directory's ``slurm/``: where each is, and the
two formats the harness writes there and reads back.

``slurm/`` is submitit's folder (submission scripts, its logs and result pickles), so every run
has a fresh one. Beside submitit's files the harness keeps ``jobs.json`` (how to load the suite
again, the profile, each group's job: written at submission, read by ``harness collect``) and each
task's ``<job>_<task>_result.json`` (how its worker ended: written by the task, slurm/task.py, read
by the watch). Only JSON is read back: the run directory is on a filesystem others may write, and
loading submitit's pickles would run whatever they hold.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.files import write_json_atomic

JOB_DIR = "slurm"  # in the run directory: submitit's files and jobs.json
JOBS_FILE = "jobs.json"
RESULT_FILE = "result.json"  # a task's outcome, beside submitit's result.pkl: <job>_<task>_result.json
# A task's result, field -> type; "rank" and "exitcode" always, the rest where known.
_RESULT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rank": int,
    "exitcode": int,
    "pid": int,
    "died_at": (int, float),
    "host": str,
    "traceback": str,  # the task itself raised, outside its worker
}


@dataclass(frozen=True)
class SlurmJob:
    """One launch group's job, as jobs.json records it."""

    group: str
    job_id: str
    nodes: int
    tasks_per_node: int

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node

    def file(self, run_dir: Path, suffix: str, task: int = 0) -> Path:
        return job_file(run_dir, self.job_id, task, suffix)


def job_file(run_dir: Path, job_id: str, task: int, suffix: str) -> Path:
    """One of a job's files for task ``task``: submitit's ``log.err``, ``log.out``, ``result.pkl``, or
    the task's own ``result.json``."""
    return run_dir / JOB_DIR / f"{job_id}_{task}_{suffix}"


def write_jobs(run_dir: Path, source: dict[str, Any], profile: dict[str, Any], jobs: list[SlurmJob]) -> None:
    """Writes ``slurm/jobs.json`` (atomically): ``source`` says how to load the suite again."""
    record = {"source": source, "profile": profile, "jobs": [dataclasses.asdict(job) for job in jobs]}
    write_json_atomic(run_dir / JOB_DIR / JOBS_FILE, record)


def read_jobs(run_dir: Path) -> tuple[dict[str, Any], list[SlurmJob]]:
    """``slurm/jobs.json`` of a submitted run: how to load its suite, and its jobs."""
    record = json.loads((run_dir / JOB_DIR / JOBS_FILE).read_text())
    return record["source"], [SlurmJob(**job) for job in record["jobs"]]


def result_file(run_dir: Path, job_id: str, task: int) -> Path:
    """Where task ``task`` of job ``job_id`` leaves its outcome."""
    return job_file(run_dir, job_id, task, RESULT_FILE)


def write_result(path: Path, result: dict[str, Any]) -> None:
    """A task's outcome, atomically, in the form :func:`read_results` accepts (it raises otherwise:
    a result the watch would ignore must not be written silently)."""
    if not _is_result(result, result.get("rank")):
        raise ValueError(f"{path}: not a task result: {result!r}")
    write_json_atomic(path, result)


def read_results(run_dir: Path, job: SlurmJob) -> dict[int, dict[str, Any]]:
    """Task -> its outcome (the JSON run_task wrote), for the tasks whose result reads as one; a
    missing, torn or malformed result is no result. A task that raised itself (outside the worker)
    has ``{"traceback": ...}``. Only JSON is read: loading submitit's pickles would run their payload."""
    results = {}
    for task in range(job.tasks):
        result = _read_result(result_file(run_dir, job.job_id, task))
        if _is_result(result, task):
            results[task] = result
    return results


def _read_result(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_result(result: Any, task: int) -> bool:
    """Whether ``result`` is task ``task``'s outcome as run_task writes it: its rank, an exit code, and
    fields of the types the watch reads."""
    if not isinstance(result, dict) or result.get("rank") != task or "exitcode" not in result:
        return False
    return all(
        isinstance(result[key], kind) and not isinstance(result[key], bool)
        for key, kind in _RESULT_FIELDS.items()
        if key in result
    )
