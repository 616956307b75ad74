"""Start the ranks of one launch group with torch's elastic launcher, and enforce the deadline.

The harness process is the elastic agent (programmatic torchrun): workers are
``python -m harness.rank RUN_DIR GROUP``, rendezvous is c10d on 127.0.0.1 at a port the OS
picked, so concurrent runs never collide. The agent already tears the group down when one
rank fails; what it lacks is a wall-clock limit, so a watchdog thread adds one: at the
deadline it asks every rank for a faulthandler stack dump (SIGUSR1, into the rank's log), then
kills each rank's process group (deadline.py). Workers also die with the harness
(PR_SET_PDEATHSIG), so no rank outlives the run.

Logs: ``logs/rank<k>.log`` (stdout and stderr) when a suite has one launch group; with several,
``logs/<group>/rank<k>.log``, a group being named after its arms (``procs``, ``eager+graph``).
The agent's own messages go to ``logs/launcher.log``.

When ranks fail, the root cause is the rank that died first: an exit recorder watches every
rank through a pidfd and timestamps each death as it happens, so a rank killed by SIGKILL is
blamed rather than the peer that then lost its connection. failures.py picks that root cause and
triage.py judges it. SIGINT and SIGTERM stay with the harness (cancel.py), not the agent.
"""

from __future__ import annotations

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
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from harness.launchers import SHUTDOWN_GRACE_S, LaunchContext, LaunchResult
from harness.launchers.deadline import StackDumps, dump_stacks_then_kill
from harness.launchers.failures import (
    FULL_DISK,
    describe_failures,
    disk_full,
    judge_failure,
    readable_error_file,
    release_error_rooms,
)
from harness.plan import LaunchGroup
from harness.rank.process import AGENT_PID_ENV
from harness.rundir import LAUNCHER_LOG, QuietFileHandler
from harness.triage import INFRASTRUCTURE, Verdict, oom_kills

WATCH_INTERVAL_S = 0.2


class _RankLogs(LogsSpecs):
    """stdout and stderr of rank k into one file (the rank dup2s stderr onto stdout)."""

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


def _signal_groups(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # each worker leads its own session (start_new_session)
        except ProcessLookupError:
            pass


class _Watchdog(threading.Thread):
    """Calls ``tick`` every interval; at the deadline dumps every rank's stack, then kills them."""

    def __init__(
        self, deadline: float, marker: str, run_dir: Path, group: LaunchGroup, tick: Callable[[], None]
    ) -> None:
        super().__init__(daemon=True, name="harness-watchdog")
        self.deadline, self.marker, self.run_dir, self.group, self.tick = deadline, marker, run_dir, group, tick
        self.dumps: StackDumps | None = None  # set once the deadline fired
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(WATCH_INTERVAL_S):
            try:
                self.tick()
            except Exception as e:  # a broken progress display must not disable the deadline
                print(f"warning: progress display stopped: {type(e).__name__}: {e}", file=sys.stderr)
                self.tick = lambda: None
            if time.monotonic() >= self.deadline:
                pids = worker_pids(os.getpid(), self.marker)
                self.dumps = dump_stacks_then_kill(
                    self.run_dir,
                    self.group,
                    dump=lambda: _signal_groups(pids, signal.SIGUSR1),
                    kill=lambda: _signal_groups(pids, signal.SIGKILL),
                )
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()


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


def launch_group(group: LaunchGroup, context: LaunchContext) -> LaunchResult:
    """Runs every arm of ``group`` in ``group.ranks`` fresh processes, with ``context.env`` exported
    to them.

    Never raises for rank failures; ``Cancelled`` (a signal to the harness) passes through once the
    ranks are gone.
    """
    run_dir, deadline, tick = context.run_dir, context.deadline, context.tick
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
    watchdog = _Watchdog(deadline, marker, run_dir, group, tick)
    exits = _ExitRecorder(marker, group.ranks)
    start = time.monotonic()
    failures: dict[int, ProcessFailure] = {}
    launch_error = None
    oom_before = oom_kills()
    worker_env = {**context.env, AGENT_PID_ENV: str(os.getpid())}  # the workers inherit the agent's environment
    watchdog.start()
    exits.start()
    try:
        with _agent_logs_to(run_dir / LAUNCHER_LOG), _worker_environment(worker_env):
            elastic_launch(config, sys.executable)("-m", "harness.rank", marker, group.name)
    except ChildFailedError as e:
        failures = e.failures
    except Exception as e:  # rendezvous or spawn: the launch itself failed
        launch_error = _launch_error(run_dir, group, e)
    finally:
        watchdog.stop()
        _signal_groups(worker_pids(os.getpid(), marker), signal.SIGKILL)  # a cancelled agent may leave ranks behind
        exits.stop()
        release_error_rooms(run_dir, group)
    tick()
    oom_during = (oom_kills() or 0) - (oom_before or 0)
    described = describe_failures(run_dir, group, failures, exits.died_at)
    result = LaunchResult(group, time.monotonic() - start, watchdog.dumps is not None, failures=described)
    judge_failure(result, context, watchdog.dumps, oom_during)
    if result.verdict is None and launch_error:
        result.verdict = Verdict(INFRASTRUCTURE, "launch failure")
        result.headline = result.error = launch_error
    return result


def _launch_error(run_dir: Path, group: LaunchGroup, error: Exception) -> str:
    """Why a launch failed. The elastic agent itself raises on a rank's error file that torch cannot
    read, one its rank could not finish writing (a full disk): then that rank and file are the
    news, with the space left on the disk, not the JSON parser's complaint."""
    files = [(rank, run_dir / group.error_file(rank)) for rank in range(group.ranks)]
    unreadable = [(rank, path) for rank, path in files if path.is_file() and not readable_error_file(path)]
    if not unreadable:
        return f"launch of group '{group.name}' failed: {type(error).__name__}: {error} (see {LAUNCHER_LOG})"
    rank, path = unreadable[0]
    state = "empty" if path.stat().st_size == 0 else "not one torch can read"
    full = f"{FULL_DISK}; " if disk_full(run_dir) else ""
    return (
        f"rank {rank} of group '{group.name}' failed, and its error file {group.error_file(rank)} is {state}"
        f" ({full}log: {group.log(rank)})"
    )
