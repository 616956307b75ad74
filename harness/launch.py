"""Start the ranks of one launch group with torch's elastic launcher, and enforce the deadline.

The harness process is the elastic agent (programmatic torchrun): workers are
``python -m harness.worker RUN_DIR GROUP``, rendezvous is c10d on 127.0.0.1 at a port the OS
picked, so concurrent runs never collide. The agent already tears the group down when one
rank fails; what it lacks is a wall-clock limit, so a watchdog thread adds one: at the
deadline it asks every rank for a faulthandler stack dump (SIGUSR1, into the rank's log), then
kills each rank's process group. Workers also die with the harness (PR_SET_PDEATHSIG), so no
rank outlives the run.

Logs: ``logs/rank<k>.log`` (stdout and stderr) when a suite has one launch group; with several,
``logs/<group>/rank<k>.log``, a group being named after its arms (``procs``, ``eager+graph``).
The agent's own messages go to ``logs/launcher.log``.

When ranks fail, the root cause is the rank that died first: an exit recorder watches every
rank through a pidfd and timestamps each death as it happens, so a rank killed by SIGKILL is
blamed rather than the peer that then lost its connection. triage.py judges that root cause.
SIGINT and SIGTERM stay with the harness (cancel.py), not the agent.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from harness.records import QuietFileHandler
from harness.specs import SuiteSpec
from harness.triage import INFRASTRUCTURE, Verdict, classify, exception_line, oom_kills
from harness.worker import AGENT_PID_ENV, release_error_room

# Seconds the agent waits after SIGTERM before SIGKILL, once one rank has failed.
SHUTDOWN_GRACE_S = 3
# Seconds to wait for the stack dumps after SIGUSR1, before killing hung ranks.
STACK_DUMP_WAIT_S = 3.0
WATCH_INTERVAL_S = 0.2
FULL_DISK = "No space left on device on the run directory's disk"
_LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class LaunchGroup:
    """Arms sharing a process count: they run in one launch, one after another. A throughput
    run's group instead times the block positions in ``measurements`` (harness/throughput.py)."""

    name: str
    ranks: int
    arms: tuple[str, ...]
    log_dir: str  # relative to the run directory
    measurements: tuple[Any, ...] = ()  # harness.throughput.Measurement

    def log(self, rank: int) -> str:
        return f"{self.log_dir}/rank{rank}.log"

    def error_file(self, rank: int) -> str:
        """Where the rank writes its traceback (TORCHELASTIC_ERROR_FILE), relative to the run directory."""
        return f"{self.log_dir}/rank{rank}.error.json"


def plan_launches(suite: SuiteSpec) -> list[LaunchGroup]:
    """Groups arms by process count, keeping the suite's arm order."""
    by_ranks: dict[int, list[str]] = {}
    for arm in suite.arms.values():
        by_ranks.setdefault(arm.ranks, []).append(arm.name)
    single = len(by_ranks) == 1
    return [
        LaunchGroup("+".join(arms), ranks, tuple(arms), "logs" if single else f"logs/{'+'.join(arms)}")
        for ranks, arms in by_ranks.items()
    ]


@dataclass
class RankFailure:
    """One rank that ended badly, as the agent reported it and the exit recorder timed it."""

    rank: int
    exitcode: int  # negative: killed by that signal
    message: str  # a traceback where the rank left one, else how it ended
    log: str  # relative to the run directory
    traceback: str | None = None
    died_at: float | None = None  # monotonic seconds, from the exit recorder
    root_cause: bool = False


@dataclass
class LaunchResult:
    """How one launch group ended; ``verdict`` judges its root-cause failure (triage.py)."""

    group: LaunchGroup
    duration_s: float
    timed_out: bool = False
    error: str | None = None  # set when the group failed; one paragraph for the user
    headline: str | None = None  # the same, in one line
    failures: list[RankFailure] = field(default_factory=list)
    verdict: Verdict | None = None  # set when the group failed
    job: dict[str, Any] | None = None  # the Slurm job that ran the group (slurm.py): id, state, stderr

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def root(self) -> RankFailure | None:
        return next((f for f in self.failures if f.root_cause), None)


class GroupLauncher(Protocol):
    """Runs one launch group to its end and says how it ended: ``launch_group`` here, or a Slurm
    job (harness/slurm.py). Never raises for rank failures; ``Cancelled`` passes through."""

    def __call__(
        self,
        run_dir: Path,
        group: LaunchGroup,
        *,
        deadline: float,
        timeout_s: float,
        env: dict[str, str] | None = None,
        tick: Callable[[], None] = ...,
    ) -> LaunchResult: ...


class _RankLogs(LogsSpecs):
    """stdout and stderr of rank k into one file (the worker dup2s stderr onto stdout)."""

    def __init__(self, run_dir: Path, group: LaunchGroup) -> None:
        super().__init__(str(run_dir / group.log_dir))
        self._run_dir, self._group = run_dir, group
        self._dir = run_dir / group.log_dir

    @property
    def root_log_dir(self) -> str:
        return str(self._dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        self._dir.mkdir(parents=True, exist_ok=True)
        logs = {k: str(self._run_dir / self._group.log(k)) for k in envs}
        errors = {k: str(self._run_dir / self._group.error_file(k)) for k in envs}
        for k, env in envs.items():
            env["TORCHELASTIC_ERROR_FILE"] = errors[k]
        return LogsDest(stdouts=logs, stderrs=dict(logs), error_files=errors)


def free_port() -> int:
    """A port the OS just handed out; the c10d store binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_pids(parent: int, marker: str) -> list[int]:
    """Children of ``parent`` whose command line contains ``marker``, read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # each worker leads its own session (start_new_session)
    except ProcessLookupError:
        pass


class _Watchdog(threading.Thread):
    """Calls ``tick`` every interval; at the deadline dumps every rank's stack, then kills them."""

    def __init__(self, deadline: float, marker: str, log_dir: Path, ranks: int, tick: Callable[[], None]) -> None:
        super().__init__(daemon=True, name="harness-watchdog")
        self.deadline, self.marker, self.log_dir, self.ranks, self.tick = deadline, marker, log_dir, ranks, tick
        self.fired = False
        self.dumped: list[int] = []  # ranks whose logs grew after SIGUSR1: their stacks are there
        self.silent: list[int] = []  # ranks that left no stack: not yet started, or not yet armed
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(WATCH_INTERVAL_S):
            try:
                self.tick()
            except Exception as e:  # a broken progress display must not disable the deadline
                print(f"warning: progress display stopped: {type(e).__name__}: {e}", file=sys.stderr)
                self.tick = lambda: None
            if time.monotonic() >= self.deadline:
                self.fired = True
                self._dump_and_kill()
                return

    def _dump_and_kill(self) -> None:
        pids = worker_pids(os.getpid(), self.marker)
        logs = {int(log.stem.removeprefix("rank")): log for log in self.log_dir.glob("rank*.log")}
        sizes = {rank: log.stat().st_size for rank, log in logs.items()}
        for pid in pids:
            _signal_group(pid, signal.SIGUSR1)
        give_up = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < give_up and any(log.stat().st_size == sizes[r] for r, log in logs.items()):
            time.sleep(0.05)
        for pid in pids:
            _signal_group(pid, signal.SIGKILL)
        self.dumped = sorted(r for r, log in logs.items() if log.stat().st_size > sizes[r] and has_stack(log))
        self.silent = sorted(set(range(self.ranks)) - set(self.dumped))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def has_stack(log: Path) -> bool:
    """Whether a rank log holds a faulthandler stack dump."""
    return "(most recent call first)" in log.read_text(errors="replace")


class _ExitRecorder(threading.Thread):
    """Timestamps each rank's death the moment it happens (its pidfd turns readable), so the rank
    that died first is known even when its peers fail milliseconds later."""

    def __init__(self, marker: str, ranks: int) -> None:
        super().__init__(daemon=True, name="harness-exit-recorder")
        self.marker, self.ranks = marker, ranks
        self.died_at: dict[int, float] = {}  # pid -> monotonic seconds
        self._halt = threading.Event()

    def run(self) -> None:
        poller, fds = select.poll(), {}
        while not self._halt.is_set():
            if len(fds) < self.ranks:
                for pid in set(worker_pids(os.getpid(), self.marker)) - set(fds.values()):
                    try:
                        fd = os.pidfd_open(pid)
                    except OSError:  # already reaped: its death time stays unknown
                        continue
                    fds[fd] = pid
                    poller.register(fd, select.POLLIN)
            for fd, _ in poller.poll(50):
                self.died_at.setdefault(fds[fd], time.monotonic())
                poller.unregister(fd)
        for fd in fds:
            os.close(fd)

    def stop(self) -> None:
        self._halt.set()
        self.join()


@contextmanager
def _worker_environment(env: dict[str, str]) -> Iterator[None]:
    """Exports ``env`` to the ranks (the agent hands them a copy of os.environ), then restores it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _agent_logs_to(path: Path) -> Iterator[None]:
    """The elastic agent logs to the console; keep the console for the verdict."""
    handler = QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, (propagate, level) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate, lg.level = propagate, level
        handler.close()


def launch_group(
    run_dir: Path,
    group: LaunchGroup,
    *,
    deadline: float,
    timeout_s: float,
    env: dict[str, str] | None = None,
    tick: Callable[[], None] = lambda: None,
) -> LaunchResult:
    """Runs every arm of ``group`` in ``group.ranks`` fresh processes, with ``env`` exported to them.

    Never raises for rank failures; ``Cancelled`` (a signal to the harness) passes through once the
    ranks are gone.
    """
    log_dir = run_dir / group.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=group.ranks,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": max(1, int(deadline - time.monotonic()))},
        run_id=f"harness-{uuid.uuid4().hex[:12]}",
        max_restarts=0,
        monitor_interval=0.1,
        logs_specs=_RankLogs(run_dir, group),
        local_addr="127.0.0.1",
        shutdown_timeout=SHUTDOWN_GRACE_S,
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGINT and SIGTERM stay with the harness (cancel.py)
    )
    marker = str(run_dir.resolve())
    watchdog = _Watchdog(deadline, marker, log_dir, group.ranks, tick)
    exits = _ExitRecorder(marker, group.ranks)
    start = time.monotonic()
    failures: dict[int, ProcessFailure] = {}
    launch_error = None
    oom_before = oom_kills()
    worker_env = {**(env or {}), AGENT_PID_ENV: str(os.getpid())}  # the workers inherit the agent's environment
    watchdog.start()
    exits.start()
    try:
        with _agent_logs_to(run_dir / "logs" / "launcher.log"), _worker_environment(worker_env):
            elastic_launch(config, sys.executable)("-m", "harness.worker", marker, group.name)
    except ChildFailedError as e:
        failures = e.failures
    except Exception as e:  # rendezvous or spawn: the launch itself failed
        launch_error = _launch_error(run_dir, group, e)
    finally:
        watchdog.stop()
        for pid in worker_pids(os.getpid(), marker):  # a cancelled agent may leave ranks behind
            _signal_group(pid, signal.SIGKILL)
        exits.stop()
        release_error_rooms(run_dir, group)
    tick()
    oom_during = (oom_kills() or 0) - (oom_before or 0)
    described = describe_failures(run_dir, group, failures, exits.died_at)
    result = LaunchResult(group, time.monotonic() - start, watchdog.fired, failures=described)
    if watchdog.fired:
        result.verdict = Verdict(INFRASTRUCTURE, "timeout")
    elif result.root is not None:
        result.verdict = classify(result.root.exitcode, result.root.traceback, oom_during)
    elif launch_error:
        result.verdict = Verdict(INFRASTRUCTURE, "launch failure")
    result.headline, result.error = explain(result, timeout_s, launch_error, watchdog.dumped, watchdog.silent)
    return result


def release_error_rooms(run_dir: Path, group: LaunchGroup) -> None:
    """Frees the space the group's ranks claimed for error files they never wrote: a rank killed
    before its end cannot free its own."""
    for rank in range(group.ranks):
        release_error_room(run_dir / group.error_file(rank))


def _launch_error(run_dir: Path, group: LaunchGroup, error: Exception) -> str:
    """Why a launch failed. The elastic agent itself raises on a rank's error file that torch cannot
    read, one its rank could not finish writing (a full disk): then that rank and file are the
    news, with the space left on the disk, not the JSON parser's complaint."""
    files = [(rank, run_dir / group.error_file(rank)) for rank in range(group.ranks)]
    unreadable = [(rank, path) for rank, path in files if path.is_file() and not _readable_error_file(path)]
    if not unreadable:
        return f"launch of group '{group.name}' failed: {type(error).__name__}: {error} (see logs/launcher.log)"
    rank, path = unreadable[0]
    state = "empty" if path.stat().st_size == 0 else "not one torch can read"
    full = f"{FULL_DISK}; " if _disk_full(run_dir) else ""
    return (
        f"rank {rank} of group '{group.name}' failed, and its error file {group.error_file(rank)} is {state}"
        f" ({full}log: {group.log(rank)})"
    )


def _disk_full(path: Path) -> bool:
    """Whether the disk holding ``path`` has no space left: a rank there can write nothing, not even why it failed."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail == 0


def _readable_error_file(path: Path) -> bool:
    """Whether torch's reader of a rank's error file (ProcessFailure) takes it: it raises on one that is
    empty or torn (its rank could not finish writing it) or of another format."""
    try:
        info = json.loads(path.read_text())["message"]["extraInfo"]
        int(info["timestamp"])
        return isinstance(info["py_callstack"], str)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def process_failure(rank: int, pid: int, exitcode: int, error_file: Path) -> ProcessFailure:
    """torch's record of a failed rank, which reads its error file: only a readable one, else none."""
    return ProcessFailure(rank, pid, exitcode, str(error_file) if _readable_error_file(error_file) else "")


def explain(
    result: LaunchResult, timeout_s: float, launch_error: str | None, dumped: list[int], silent: list[int]
) -> tuple[str | None, str | None]:
    """(one line, full text) of what went wrong, or (None, None). ``dumped`` and ``silent``: after a
    timeout, the ranks whose Python stacks are in their logs, and those that left none."""
    group = result.group
    if result.timed_out:
        stacks = f"ranks {dumped}: Python stacks dumped to {group.log('<k>')}" if dumped else ""
        none = f"ranks {silent}: no stack (still starting up, before the dump handler)" if silent else ""
        text = f"group '{group.name}' timed out after --timeout {timeout_s:g}s; " + "; ".join(
            filter(None, [stacks, none])
        )
        return text, text + "; the ranks were killed"
    root = result.root
    if root is not None:
        how = result.verdict.reason if root.exitcode < 0 else f"{_ending(root.exitcode)}, {result.verdict.reason}"
        cause = root.message.strip().splitlines()[-1]
        headline = f"rank {root.rank} failed first ({how}): {cause}"
        lines = [f"rank {root.rank} of group '{group.name}' failed first ({how}; log: {root.log}): {cause}"]
        lines += ["    " + line for line in root.message.rstrip().splitlines()]
        others = [
            f"rank {f.rank} {_ending(f.exitcode)}" + (f" ({exception_line(f.traceback)[:160]})" if f.traceback else "")
            for f in result.failures
            if not f.root_cause
        ]
        if others:
            lines.append("then, as a consequence: " + "; ".join(others))
        return headline, "\n".join(lines)
    if launch_error:
        return launch_error, launch_error
    return None, None


def _ending(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def describe_failures(
    run_dir: Path, group: LaunchGroup, failures: dict[int, ProcessFailure], died_at: dict[int, float]
) -> list[RankFailure]:
    """One entry per failed rank; the root cause is the one that died first. A rank without a traceback
    on a full disk could not write one: the full disk is its message, not its torn log."""
    described = []
    full = bool(failures) and _disk_full(run_dir)
    no_traceback = f"{FULL_DISK}: the rank could not write its traceback" if full else None
    for rank, failure in sorted(failures.items()):
        stack = failure.error_file_data.get("message", {})
        traceback = stack.get("extraInfo", {}).get("py_callstack") if isinstance(stack, dict) else None
        message = traceback or no_traceback or _tail(run_dir / group.log(rank)) or _ending(failure.exitcode)
        described.append(
            RankFailure(rank, failure.exitcode, message, group.log(rank), traceback, died_at.get(failure.pid))
        )
    if described:
        _pick_root_cause(described, failures)
    return described


def _pick_root_cause(described: list[RankFailure], failures: dict[int, ProcessFailure]) -> None:
    timed = [f for f in described if f.died_at is not None]
    if timed:
        root = min(timed, key=lambda f: f.died_at)
    else:  # deaths not seen (reaped before the recorder looked): the earliest traceback, else an exit
        with_files = [f for f in described if os.path.isfile(failures[f.rank].error_file)]
        exited = [f for f in described if f.exitcode > 0]
        if with_files:
            root = min(with_files, key=lambda f: os.stat(failures[f.rank].error_file).st_mtime_ns)
        else:
            root = (exited or described)[0]
    root.root_cause = True


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_LOG_TAIL_LINES:])
