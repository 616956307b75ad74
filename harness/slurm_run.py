"""``harness submit`` and ``harness collect``: one run whose launch groups run as Slurm jobs.

A submitted run is prepared, judged and reported exactly as ``harness run`` does it (one code path,
``run.judge_run``); only the launcher differs: each group is a submitit job (harness/launchers/slurm/),
and the run's ``JobWatch`` waits for it and says how it ended. ``--no-wait`` queues the jobs and
exits; ``harness collect`` later loads the suite again from ``slurm/jobs.json``, checks it is what
``manifest.json`` recorded, and judges the run as ``harness submit`` would have.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from harness.kinds import run_kind
from harness.launchers import GroupLauncher, LaunchContext, LaunchResult
from harness.launchers.slurm.jobs import JOB_DIR, JOBS_FILE, SlurmJob, read_jobs
from harness.launchers.slurm.profile import SlurmProfile, check_gpus, job_shape
from harness.launchers.slurm.submit import SlurmError, cancel, require_slurm, submit_jobs
from harness.launchers.slurm.watch import JobWatch
from harness.plan import LaunchGroup
from harness.prepare import PreparedRun, RunOptions, UsageError, prepare_run, read_prepared
from harness.run import judge_run
from harness.rundir import MANIFEST
from harness.specs import SuiteSpec
from harness.suites import load_suite
from harness.triage import INFRASTRUCTURE, Verdict
from harness.verdict import EXIT_PASS


def submit_suite(
    suite: SuiteSpec,
    options: RunOptions,
    profile: SlurmProfile,
    nodes: int,
    source: dict[str, Any],
    wait: bool = True,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """``harness submit``: queues the suite's groups as Slurm jobs, then (unless not ``wait``)
    watches them and judges the run as ``harness run`` does; returns the exit code.

    Every usage error is raised (exit 2) before anything is created or queued.
    """
    require_slurm()
    for group in run_kind(suite).launches():
        check_gpus(profile, options.device, job_shape(group, nodes))
    run = prepare_run(suite, options, out, local_devices=False)
    try:
        jobs = submit_jobs(run.run_dir, suite.name, run.groups, profile, nodes, run.env, source)
    except SlurmError as e:
        return judge_run(run, _refused(str(e)), out, err)
    for job in jobs:
        shape = f"{job.nodes} node{'s' if job.nodes > 1 else ''} x {job.tasks_per_node} tasks"
        print(f"group '{job.group}': Slurm job {job.job_id} ({shape}, profile {profile.name})", file=out)
    if not wait:
        print(f"run dir: {run.run_dir}", file=out)
        print(f"judge it with: harness collect {run.run_dir}", file=out)
        return EXIT_PASS
    return _watch_and_judge(run, jobs, out, err)


def collect_run(run_dir: Path, options: RunOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """``harness collect RUN_DIR``: waits for a submitted run's jobs, if still queued or running,
    and judges the run as ``harness submit`` would have."""
    try:
        source, jobs = read_jobs(run_dir)
        device = json.loads((run_dir / MANIFEST).read_text())["device"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{run_dir}: not a submitted run directory ({JOB_DIR}/{JOBS_FILE}): {e}") from None
    suite = load_suite(source["suite"], [tuple(item) for item in source["overrides"]], device=device)
    return _watch_and_judge(read_prepared(run_dir, suite, options), jobs, out, err)


def _watch_and_judge(run: PreparedRun, jobs: list[SlurmJob], out: TextIO, err: TextIO) -> int:
    """Judges the run as its jobs end; whatever ends the judging cancels the jobs still queued."""
    watch = JobWatch(jobs, run.options.timeout_s)
    try:
        return judge_run(run, watch, out, err)
    finally:
        cancel(watch.unfinished())


def _refused(message: str) -> GroupLauncher:
    """A launcher for a run whose jobs Slurm refused: its first group failed to launch."""

    def launch(group: LaunchGroup, context: LaunchContext) -> LaunchResult:
        result = LaunchResult(group, 0.0, error=message, headline=message)
        result.verdict = Verdict(INFRASTRUCTURE, "launch failure")
        return result

    return launch
