"""Watching a submitted run's jobs: the GroupLauncher of ``harness submit`` and ``harness collect``.

Without Slurm accounting ``sacct`` fails and submitit's ``job.results()`` waits forever for a job
that died without a result, so the watch polls ``squeue`` and the tasks' JSON results
(slurm/jobs.py) itself, and hands how each job ended to the judging every run shares, as a
``LaunchResult``:

- every task's result is in: the group ran; a failed rank is judged as locally (failures.py,
  triage.py); a result that is missing or does not read as one is no result;
- a rank failed: its peers get a moment to fail on their own, then the job is cancelled, as the
  elastic agent tears down a group locally;
- the job was cancelled, timed out, OOM-killed, preempted or lost its node, or it left the queue
  without every result: infrastructure (exit 3) within seconds, naming the job id, its Slurm state
  (from squeue, else from what slurmstepd wrote into the job's stderr) and the tail of its stderr;
- ``--timeout`` counts running time only (not time in the queue): at the deadline every rank
  dumps its Python stack into its log (``scancel --signal=USR1``), then the job is cancelled
  (deadline.py).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.launchers import SHUTDOWN_GRACE_S, LaunchContext, LaunchResult, RankFailure
from harness.launchers.deadline import StackDumps, dump_stacks_then_kill
from harness.launchers.failures import describe_failures, judge_failure, log_tail, process_failure, release_error_rooms
from harness.launchers.slurm.jobs import JOB_DIR, SlurmJob, read_results
from harness.launchers.slurm.submit import cancel
from harness.plan import LaunchGroup
from harness.triage import INFRASTRUCTURE, Verdict

# squeue states (%T) of a job that ended without finishing its work.
LOST_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}
)
# What slurmstepd writes into a job's stderr as it ends one: the state once squeue forgot the job.
_STEPD_STATES = (
    (re.compile(r"CANCELLED AT \S+ DUE TO TIME LIMIT"), "TIMEOUT"),
    (re.compile(r"CANCELLED AT \S+ DUE TO PREEMPTION"), "PREEMPTED"),
    (re.compile(r"DUE TO NODE FAILURE"), "NODE_FAIL"),
    (re.compile(r"oom[-_ ]kill", re.IGNORECASE), "OUT_OF_MEMORY"),
    (re.compile(r"\*\*\* (JOB|STEP) \S+ ON \S+ CANCELLED AT"), "CANCELLED"),
)
_STATE_WORDS = {
    "TIMEOUT": "hit its Slurm time limit",
    "CANCELLED": "was cancelled",
    "OUT_OF_MEMORY": "was killed for running out of memory",
    "PREEMPTED": "was preempted",
    "NODE_FAIL": "lost its node",
    "BOOT_FAIL": "could not boot its node",
    "DEADLINE": "passed its deadline",
    "FAILED": "failed",
}
RESULT_GRACE_S = 3.0  # after a job left the queue: how long its result files may lag (shared filesystem)
SQUEUE_GRACE_S = 60.0  # squeue failing for this long (the controller unreachable) loses the job
POLL_S = 0.3


def squeue_state(job_id: str) -> tuple[str | None, str | None]:
    """(state, error): the job's state while squeue lists it (completed ones too, until Slurm
    forgets them), (None, None) once it does not, (None, message) when squeue itself failed."""
    proc = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if proc.returncode != 0:
        if "Invalid job id" in proc.stderr:
            return None, None
        return None, proc.stderr.strip() or f"squeue exit code {proc.returncode}"
    state = proc.stdout.split()
    return (state[0] if state else None), None


def stepd_state(stderr: str) -> str | None:
    """The state slurmstepd announced in a job's stderr, if it ended the job."""
    return next((state for pattern, state in _STEPD_STATES if pattern.search(stderr)), None)


@dataclass
class _Watched:
    """What the watch saw of one job."""

    state: str | None = None  # the last state squeue gave
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    stopped: bool = False  # the watch cancelled it after a rank failed
    dumps: StackDumps | None = None  # set once the deadline fired: which ranks left their stacks
    lost_reason: str | None = None  # why the job is taken as lost, when squeue cannot say
    running_since: float | None = None  # monotonic seconds when squeue first said RUNNING


class JobWatch:
    """Waits for a run's jobs, one group at a time: the GroupLauncher of a submitted run.

    ``timeout_s`` (``--timeout``) bounds the jobs' running time together; time in the queue is
    not counted, since on a busy cluster it says nothing about the run.
    """

    def __init__(self, jobs: list[SlurmJob], timeout_s: float) -> None:
        self.jobs = {job.group: job for job in jobs}
        self.budget_s = timeout_s
        self.finished: set[str] = set()

    def unfinished(self) -> list[str]:
        return [job.job_id for job in self.jobs.values() if job.job_id not in self.finished]

    def __call__(self, group: LaunchGroup, context: LaunchContext) -> LaunchResult:
        """Watches the group's job to its end. Of ``context`` the run directory, ``tick`` and
        ``timeout_s`` apply; the job's environment went with its submission, and its time counts
        against the watch's budget of running time, not against ``deadline``."""
        run_dir, tick, job = context.run_dir, context.tick, self.jobs[group.name]
        start = time.monotonic()
        watched = self._watch(run_dir, group, job, tick)
        self.finished.add(job.job_id)
        release_error_rooms(run_dir, group)
        if watched.running_since is not None:
            self.budget_s -= time.monotonic() - watched.running_since
        tick()
        return self._result(run_dir, group, job, watched, time.monotonic() - start, context)

    def _watch(self, run_dir: Path, group: LaunchGroup, job: SlurmJob, tick: Callable[[], None]) -> _Watched:
        watched = _Watched()
        gone_since = failed_at = squeue_failing_since = None
        while True:
            tick()
            now = time.monotonic()
            watched.results = read_results(run_dir, job)
            state, error = squeue_state(job.job_id)
            watched.state = state or watched.state
            if error:
                squeue_failing_since = squeue_failing_since or now
                if now - squeue_failing_since >= SQUEUE_GRACE_S:
                    watched.lost_reason = f"squeue failed for {SQUEUE_GRACE_S:g} s: {error}"
                    return watched
            else:
                squeue_failing_since = None
            if len(watched.results) == job.tasks:
                return watched
            if state == "RUNNING" and watched.running_since is None:
                watched.running_since = now
            if (state is None and not error) or state in LOST_STATES or state == "COMPLETED":
                gone_since = gone_since or now  # ended: its last results may still be on their way
                if now - gone_since >= RESULT_GRACE_S:
                    return watched
            if failed_at is None and any(r["exitcode"] != 0 for r in watched.results.values()):
                failed_at = now
            if failed_at is not None and not watched.stopped and now - failed_at >= SHUTDOWN_GRACE_S:
                cancel([job.job_id])  # peers still waiting on the failed rank: tear the group down
                watched.stopped = True
            running = now - watched.running_since if watched.running_since is not None else 0.0
            if running >= self.budget_s and watched.dumps is None:
                watched.dumps = dump_stacks_then_kill(
                    run_dir, group, dump=lambda: cancel([job.job_id], "USR1"), kill=lambda: cancel([job.job_id])
                )
                watched.stopped = True
            time.sleep(POLL_S)

    def _result(
        self,
        run_dir: Path,
        group: LaunchGroup,
        job: SlurmJob,
        watched: _Watched,
        duration_s: float,
        context: LaunchContext,
    ) -> LaunchResult:
        """How the job ended, as a launch result: a lost job, a timeout, failed ranks, or none."""
        stderr_path = job.file(run_dir, "log.err")
        stderr = log_tail(stderr_path)
        missing = sorted(set(range(job.tasks)) - set(watched.results))
        state = _final_state(watched, stderr, missing)
        info = {"id": job.job_id, "state": state, "stderr": str(stderr_path.relative_to(run_dir))}
        result = LaunchResult(group, duration_s, watched.dumps is not None, job=info | {"stderr_tail": stderr})
        result.failures = _rank_failures(run_dir, group, watched.results)
        lost = not watched.stopped and (state in LOST_STATES or missing or watched.lost_reason)
        if lost:
            result.verdict = Verdict(INFRASTRUCTURE, f"Slurm job {state or 'lost'}")
            result.headline, result.error = _lost(group, job, state, missing, watched, result, stderr)
        else:
            judge_failure(result, context, watched.dumps)
            if result.ok:
                return result
        result.error += f"\n(Slurm job {job.job_id}; its files: {JOB_DIR}/{job.job_id}_*)"
        return result


def _final_state(watched: _Watched, stderr: str, missing: list[int]) -> str | None:
    """The job's Slurm state as it ended: squeue's, else slurmstepd's word in its stderr, else
    what the tasks' results say (all in: it completed, or the watch cancelled it)."""
    if watched.state in LOST_STATES:
        return watched.state
    if announced := stepd_state(stderr):
        return announced
    if missing:
        return watched.state
    return "CANCELLED" if watched.stopped else "COMPLETED"


def _rank_failures(run_dir: Path, group: LaunchGroup, results: dict[int, dict[str, Any]]) -> list[RankFailure]:
    """The failed ranks among the tasks' results, described as a local group's are."""
    failures = {
        r["rank"]: process_failure(r["rank"], r.get("pid", 0), r["exitcode"], run_dir / group.error_file(r["rank"]))
        for r in results.values()
        if r["exitcode"] != 0
    }
    died_at = {r.get("pid", 0): r["died_at"] for r in results.values() if "died_at" in r}
    described = describe_failures(run_dir, group, failures, died_at)
    for failure in described:  # a task that raised itself, outside its worker: its result has the traceback
        raised = next((r.get("traceback") for r in results.values() if r["rank"] == failure.rank), None)
        if raised:
            failure.traceback = failure.message = raised
    return described


def _lost(
    group: LaunchGroup,
    job: SlurmJob,
    state: str | None,
    missing: list[int],
    watched: _Watched,
    result: LaunchResult,
    stderr: str,
) -> tuple[str, str]:
    """(one line, full text) for a job that ended without finishing its work."""
    how = _STATE_WORDS.get(state or "", f"ended {state}" if state else "left the queue")
    without = f" without a result from task(s) {missing}" if missing else ""
    reason = f" ({watched.lost_reason})" if watched.lost_reason else ""
    headline = f"Slurm job {job.job_id} of group '{group.name}' {how}{without}{reason}"
    lines = [headline + f" (state: {state or 'unknown'})"]
    lines += [f"rank {f.rank}: {f.message.strip().splitlines()[-1]} (log: {f.log})" for f in result.failures]
    if stderr:
        lines += [f"tail of its stderr ({JOB_DIR}/{job.job_id}_0_log.err):"] + ["    " + s for s in stderr.splitlines()]
    return headline, "\n".join(lines)
