"""Suites on Slurm through submitit: ``harness submit`` and ``harness collect``.

Each launch group of a run becomes one submitit job of ``nodes`` x ``ranks / nodes`` tasks; the
jobs are chained with ``afterany`` dependencies, so the groups run one after another as they do
locally, and all are queued at once (``--no-wait``). Each task (``run_task``) exports
torch.distributed's environment from Slurm's (``submitit.helpers.TorchDistributedEnvironment``:
MASTER_ADDR is the first node of the job's node list, RANK the task's global rank), so one
rendezvous spans every node, and runs the same worker as a local launch,
``python -m harness.worker RUN_DIR GROUP``, its output in the same ``logs/rank<k>.log`` and its
traceback in the same ``rank<k>.error.json``. A task writes how its worker ended, or its own
traceback if it raised, to ``slurm/<job>_<task>_result.json``.

The job files (submission script, submitit's logs and results, the tasks' JSON results) and
``jobs.json`` live in the run directory's ``slurm/``. The submitting process, or ``harness collect``
later, watches each job itself (``JobWatch``) and hands how it ended to the judging every run
shares (``run.judge_run``). Without Slurm accounting ``sacct`` fails and ``job.results()`` waits
forever for a job that died without a result, so the watch polls ``squeue`` and the tasks' JSON
results; it never unpickles submitit's ``*_result.pkl``: the run directory is on a shared
filesystem others may write, and loading a pickle runs whatever it holds.

- every task's result is in: the group ran; a failed rank is judged as locally (triage.py);
  a result that is missing or does not read as one is no result;
- a rank failed: its peers get a moment to fail on their own, then the job is cancelled, as the
  elastic agent tears down a group locally;
- the job was cancelled, timed out, OOM-killed, preempted or lost its node, or it left the queue
  without every result: infrastructure (exit 3) within seconds, naming the job id, its Slurm state
  (from squeue, else from what slurmstepd wrote into the job's stderr) and the tail of its stderr;
- ``--timeout`` counts running time only (not time in the queue): at the deadline every rank
  dumps its Python stack into its log (SIGUSR1), then the job is cancelled.

Profiles (``slurm/<name>.toml``) say where and how the jobs run; they are validated as suite
fields are (exit 2 naming the file and field). Every value that reaches the job script is quoted:
submitit quotes the ``#SBATCH`` values, and ``env`` becomes ``export NAME=<quoted value>``; the
``setup`` lines are the one exception, shell commands written as the user wants them run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from harness.launch import (
    SHUTDOWN_GRACE_S,
    STACK_DUMP_WAIT_S,
    GroupLauncher,
    LaunchGroup,
    LaunchResult,
    RankFailure,
    describe_failures,
    explain,
    has_stack,
    process_failure,
    release_error_rooms,
)
from harness.records import write_json_atomic
from harness.run import (
    EXIT_PASS,
    PreparedRun,
    RunOptions,
    UsageError,
    judge_run,
    plan_groups,
    prepare_run,
    read_prepared,
)
from harness.shipped import shipped_dir
from harness.specs import SuiteSpec
from harness.suites import SuiteError, display_path, field_reader, load_suite
from harness.triage import INFRASTRUCTURE, Verdict, classify
from harness.worker import AGENT_PID_ENV, release_error_room

PROFILES_DIR = shipped_dir("slurm")
PROFILE_KEYS = (
    "description",
    "partition",
    "account",
    "qos",
    "constraint",
    "gpus_per_node",
    "cpus_per_task",
    "mem_gb",
    "time",
    "setup",
    "env",
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
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
_TAIL_LINES = 20


class SlurmError(Exception):
    """Slurm refused a submission or cannot be reached; an infrastructure failure (exit 3)."""


@dataclass(frozen=True)
class SlurmProfile:
    """A cluster profile, ``slurm/<name>.toml``: where the jobs run and what each task gets."""

    name: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    time_min: int = 60  # Slurm's own limit per job; its granularity is a minute
    setup: tuple[str, ...] = ()  # shell lines before the tasks start: module loads, venv activation
    env: dict[str, str] = field(default_factory=dict)  # exported to the tasks (NCCL settings)

    def script_setup(self) -> list[str]:
        """The job script's setup: the profile's lines as written, then its environment, quoted."""
        return [*self.setup, *(f"export {name}={shlex.quote(value)}" for name, value in self.env.items())]


def profile_path(name_or_path: str) -> Path:
    """``--profile``: a path to a TOML file, or the name of one under slurm/."""
    path = Path(name_or_path)
    return path if path.suffix == ".toml" or path.is_file() else PROFILES_DIR / f"{name_or_path}.toml"


def load_profile(name_or_path: str | None, flags: dict[str, tuple[str, Any]] | None = None) -> SlurmProfile:
    """Reads and validates a profile (None: none, Slurm's defaults); ``flags`` maps a profile key to
    (the flag that sets it, value), e.g. ``{"time": ("--time", 5)}``, validated as the file's
    fields are and named in errors."""
    raw: dict[str, Any] = {}
    path, shown = Path("default"), "--profile"
    if name_or_path is not None:
        path = profile_path(name_or_path)
        shown = display_path(path)
        if not path.is_file():
            known = ", ".join(p.stem for p in sorted(PROFILES_DIR.glob("*.toml")))
            raise SuiteError(f"{shown}: no such Slurm profile (profiles: {known})")
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SuiteError(f"{shown}: invalid TOML: {e}") from None
    v = field_reader(shown)
    for key, (flag, value) in (flags or {}).items():
        raw[key] = value
        v.origins[key] = flag
    v.table(raw, "", PROFILE_KEYS)
    strings = {key: v.str_(raw[key], key) for key in ("partition", "account", "qos", "constraint") if key in raw}
    setup = raw.get("setup", [])
    if not isinstance(setup, list):
        raise v.error("setup", f"expected a list of shell lines, got {json.dumps(setup)}")
    for i, line in enumerate(setup):
        if "\n" in v.str_(line, f"setup.{i}"):
            raise v.error(f"setup.{i}", "expected one line, got a string with a newline")
    env = raw.get("env", {})
    if not isinstance(env, dict):
        raise v.error("env", f'expected a table of NAME = "value", got {json.dumps(env)}')
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise v.error(f"env.{name}", "expected an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        v.typed(value, f"env.{name}", str, False)
    return SlurmProfile(
        name=path.stem,
        **strings,
        gpus_per_node=v.int_(raw.get("gpus_per_node", 0), "gpus_per_node", lo=0),
        cpus_per_task=v.int_(raw.get("cpus_per_task", 1), "cpus_per_task"),
        mem_gb=v.typed(raw["mem_gb"], "mem_gb", float, True) if "mem_gb" in raw else None,
        time_min=v.int_(raw.get("time", 60), "time"),
        setup=tuple(setup),
        env=dict(env),
    )


def job_shape(group: LaunchGroup, nodes: int) -> int:
    """Tasks per node of a group's job: its ranks spread evenly over ``nodes``."""
    if nodes < 1 or group.ranks % nodes:
        raise SuiteError(f"--nodes {nodes}: group '{group.name}' has {group.ranks} ranks, not a multiple of {nodes}")
    return group.ranks // nodes


def check_gpus(profile: SlurmProfile, device: str, tasks_per_node: int) -> None:
    """``--device cuda`` runs one rank per GPU: the profile must give each node enough."""
    if device == "cuda" and profile.gpus_per_node < tasks_per_node:
        raise SuiteError(
            f"--device cuda: {tasks_per_node} ranks per node need gpus_per_node >= {tasks_per_node}"
            f" (profile {profile.name}: {profile.gpus_per_node}; or --gpus-per-node)"
        )


def executor_parameters(
    profile: SlurmProfile, name: str, nodes: int, tasks_per_node: int, after: str | None
) -> dict[str, Any]:
    """submitit's parameters for one group's job; ``after``: the job it waits for (afterany)."""
    optional = {
        "slurm_partition": profile.partition,
        "slurm_account": profile.account,
        "slurm_qos": profile.qos,
        "slurm_constraint": profile.constraint,
        "gpus_per_node": profile.gpus_per_node or None,
        "mem_gb": profile.mem_gb,
    }
    # submitit asks Slurm for SIGUSR2 90 s before the time limit, for checkpointing the harness does not
    # use; a job shorter than that gets it at once, before any handler, and dies of it. SIGURG is ignored.
    additional = {"signal": "URG@90", **({"dependency": f"afterany:{after}"} if after else {})}
    return {
        "name": name,
        "nodes": nodes,
        "tasks_per_node": tasks_per_node,
        "cpus_per_task": profile.cpus_per_task,
        "timeout_min": profile.time_min,
        "slurm_setup": profile.script_setup(),
        "slurm_additional_parameters": additional,
        **{key: value for key, value in optional.items() if value is not None},
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
    record = {"source": source, "profile": dataclasses.asdict(profile), "jobs": [dataclasses.asdict(j) for j in jobs]}
    write_json_atomic(folder / JOBS_FILE, record)
    return jobs


def read_jobs(run_dir: Path) -> tuple[dict[str, Any], list[SlurmJob]]:
    """``slurm/jobs.json`` of a submitted run: how to load its suite, and its jobs."""
    record = json.loads((run_dir / JOB_DIR / JOBS_FILE).read_text())
    return record["source"], [SlurmJob(**job) for job in record["jobs"]]


def cancel(job_ids: list[str], signal_name: str | None = None) -> None:
    """``scancel`` (or sends ``signal_name`` to every step of) the jobs; a finished job is no error."""
    if job_ids:
        flags = [f"--signal={signal_name}"] if signal_name else []
        subprocess.run(["scancel", *flags, *job_ids], capture_output=True, check=False)


# --- inside a job --------------------------------------------------------------------------


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
    CUDA_VISIBLE_DEVICES stays as Slurm set it: the worker picks its GPU by LOCAL_RANK."""
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    os.environ.setdefault("MASTER_PORT", str(rendezvous_port(JobEnvironment().job_id)))  # an explicit one wins
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    return {key: os.environ[key] for key in keys}


def run_task(run_dir: str, group_name: str, env: dict[str, str]) -> dict[str, Any]:
    """One task of a group's job: rank RANK of the group, run by the same worker as a local launch.

    Writes how the worker ended to the task's ``result.json`` (atomically), and returns it; if the task
    itself raised, the result holds its traceback instead. The watch reads that JSON: submitit's
    result pickle is never loaded outside the job.
    """
    from submitit import JobEnvironment

    job = JobEnvironment()
    result_path = job_file(Path(run_dir), job.job_id, job.global_rank, RESULT_FILE)
    result_path.unlink(missing_ok=True)  # a requeued job starts clean
    try:
        result = _run_worker(run_dir, group_name, env)
    except Exception:
        write_json_atomic(result_path, {"rank": job.global_rank, "exitcode": 1, "traceback": traceback.format_exc()})
        raise
    write_json_atomic(result_path, result)
    return result


def _run_worker(run_dir: str, group_name: str, env: dict[str, str]) -> dict[str, Any]:
    """The worker of this task's rank, to its end; its output goes to the group's ``rank<k>.log`` and a
    traceback to ``rank<k>.error.json``, as under the elastic agent. The task ignores SIGUSR1, the
    stack dump the watch sends to every process of the job at --timeout."""
    rendezvous = rendezvous_env()
    rank = int(rendezvous["RANK"])
    manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    group = LaunchGroup(**next(g for g in manifest["launches"] if g["name"] == group_name))
    log = Path(run_dir) / group.log(rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    errors = Path(run_dir) / group.error_file(rank)
    errors.unlink(missing_ok=True)  # a requeued job starts clean
    worker_env = {**os.environ, **env, AGENT_PID_ENV: str(os.getpid()), "TORCHELASTIC_ERROR_FILE": str(errors)}
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the worker installs its own stack-dump handler
    with log.open("ab") as out:
        command = [sys.executable, "-m", "harness.worker", run_dir, group_name]
        worker = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=worker_env)
    exitcode = worker.wait()
    release_error_room(errors)
    return {"rank": rank, "pid": worker.pid, "exitcode": exitcode, "died_at": time.time(), "host": socket.gethostname()}


# --- watching the jobs ---------------------------------------------------------------------


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


def read_results(run_dir: Path, job: SlurmJob) -> dict[int, dict[str, Any]]:
    """Task -> its outcome (the JSON run_task wrote), for the tasks whose result reads as one; a
    missing, torn or malformed result is no result. A task that raised itself (outside the worker)
    has ``{"traceback": ...}``. Only JSON is read: loading submitit's pickles would run their payload."""
    results = {}
    for task in range(job.tasks):
        result = _read_result(job.file(run_dir, RESULT_FILE, task))
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


def stepd_state(stderr: str) -> str | None:
    """The state slurmstepd announced in a job's stderr, if it ended the job."""
    return next((state for pattern, state in _STEPD_STATES if pattern.search(stderr)), None)


def _tail(path: Path) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-_TAIL_LINES:])
    except OSError:
        return ""


@dataclass
class _Watched:
    """What the watch saw of one job."""

    state: str | None = None  # the last state squeue gave
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    stopped: bool = False  # the watch cancelled it after a rank failed
    timed_out: bool = False
    dumped: list[int] = field(default_factory=list)
    silent: list[int] = field(default_factory=list)
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

    def __call__(
        self,
        run_dir: Path,
        group: LaunchGroup,
        *,
        deadline: float,
        timeout_s: float,
        env: dict[str, str] | None = None,
        tick: Callable[[], None] = lambda: None,
    ) -> LaunchResult:
        job = self.jobs[group.name]
        start = time.monotonic()
        watched = self._watch(run_dir, group, job, tick)
        self.finished.add(job.job_id)
        release_error_rooms(run_dir, group)
        if watched.running_since is not None:
            self.budget_s -= time.monotonic() - watched.running_since
        tick()
        return self._result(run_dir, group, job, watched, time.monotonic() - start, timeout_s)

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
            if running >= self.budget_s and not watched.timed_out:
                self._time_out(run_dir, group, job, watched)
            time.sleep(POLL_S)

    def _time_out(self, run_dir: Path, group: LaunchGroup, job: SlurmJob, watched: _Watched) -> None:
        """Every rank dumps its Python stack into its log (faulthandler, SIGUSR1), then the job is cancelled."""
        logs = {rank: run_dir / group.log(rank) for rank in range(group.ranks)}
        sizes = {rank: log.stat().st_size if log.is_file() else 0 for rank, log in logs.items()}
        cancel([job.job_id], "USR1")
        give_up = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < give_up and not all(
            log.is_file() and log.stat().st_size > sizes[rank] for rank, log in logs.items()
        ):
            time.sleep(0.1)
        cancel([job.job_id])
        watched.timed_out = watched.stopped = True
        watched.dumped = sorted(r for r, log in logs.items() if log.is_file() and has_stack(log))
        watched.silent = sorted(set(logs) - set(watched.dumped))

    def _result(
        self, run_dir: Path, group: LaunchGroup, job: SlurmJob, watched: _Watched, duration_s: float, timeout_s: float
    ) -> LaunchResult:
        """How the job ended, as a launch result: a lost job, a timeout, failed ranks, or none."""
        stderr_path = job.file(run_dir, "log.err")
        stderr = _tail(stderr_path)
        missing = sorted(set(range(job.tasks)) - set(watched.results))
        state = _final_state(watched, stderr, missing)
        info = {"id": job.job_id, "state": state, "stderr": str(stderr_path.relative_to(run_dir))}
        result = LaunchResult(group, duration_s, watched.timed_out, job=info | {"stderr_tail": stderr})
        result.failures = _rank_failures(run_dir, group, watched.results)
        lost = not watched.stopped and (state in LOST_STATES or missing or watched.lost_reason)
        if watched.timed_out:
            result.verdict = Verdict(INFRASTRUCTURE, "timeout")
            result.headline, result.error = explain(result, timeout_s, None, watched.dumped, watched.silent)
        elif lost:
            result.verdict = Verdict(INFRASTRUCTURE, f"Slurm job {state or 'lost'}")
            result.headline, result.error = _lost(group, job, state, missing, watched, result, stderr)
        elif result.root is not None:
            result.verdict = classify(result.root.exitcode, result.root.traceback)
            result.headline, result.error = explain(result, timeout_s, None, [], [])
        else:
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
    """The failed ranks among the tasks' results, described as launch.py describes a local group's."""
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


# --- harness submit and harness collect ----------------------------------------------------


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
    for group in plan_groups(suite):
        check_gpus(profile, options.device, job_shape(group, nodes))
    run = prepare_run(suite, options, out, local_devices=False)
    try:
        jobs = submit_jobs(run.run_dir, suite.name, run.groups, profile, nodes, run.pin.env if run.pin else {}, source)
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
        device = json.loads((run_dir / "manifest.json").read_text())["device"]
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

    def launch(run_dir: Path, group: LaunchGroup, **_: Any) -> LaunchResult:
        result = LaunchResult(group, 0.0, error=message, headline=message)
        result.verdict = Verdict(INFRASTRUCTURE, "launch failure")
        return result

    return launch
