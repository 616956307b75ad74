"""How a launch group's ranks failed, read alike under both launchers.

Each launcher says which ranks ended badly, with their exit codes and the times they died
(local.py times deaths through pidfds, slurm/task.py records them in each task's result); the rest
is here: each failed rank's traceback from its error file (a torn or empty one is named, never
parsed), else the tail of its log, or the full disk that left it unable to write either; the root
cause, the rank that died first, so a peer's "Connection reset by peer" is a consequence, not the
news; the verdict on that root cause (triage.py); and what the user reads. At a group's end the
room its ranks claimed for their error files is released (a rank killed early cannot free its own).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from harness.launchers import LaunchContext, LaunchResult, RankFailure
from harness.launchers.deadline import StackDumps
from harness.plan import LaunchGroup
from harness.rank.errors import release_error_room
from harness.results import BAD_INPUT
from harness.triage import INFRASTRUCTURE, Verdict, classify, exception_line

FULL_DISK = "No space left on device on the run directory's disk"
_LOG_TAIL_LINES = 20


def describe_failures(
    run_dir: Path, group: LaunchGroup, failures: dict[int, ProcessFailure], died_at: dict[int, float]
) -> list[RankFailure]:
    """One entry per failed rank (``failures``: rank -> torch's record; ``died_at``: pid -> time of
    death); the root cause is the one that died first. A rank without a traceback on a full disk
    could not write one: the full disk is its message, not its torn log."""
    described = []
    full = bool(failures) and disk_full(run_dir)
    no_traceback = f"{FULL_DISK}: the rank could not write its traceback" if full else None
    for rank, failure in sorted(failures.items()):
        stack = failure.error_file_data.get("message", {})
        traceback = stack.get("extraInfo", {}).get("py_callstack") if isinstance(stack, dict) else None
        message = traceback or no_traceback or log_tail(run_dir / group.log(rank)) or _ending(failure.exitcode)
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


def process_failure(rank: int, pid: int, exitcode: int, error_file: Path) -> ProcessFailure:
    """torch's record of a failed rank, which reads its error file: only a readable one, else none."""
    return ProcessFailure(rank, pid, exitcode, str(error_file) if readable_error_file(error_file) else "")


def readable_error_file(path: Path) -> bool:
    """Whether torch's reader of a rank's error file (ProcessFailure) takes it: it raises on one that is
    empty or torn (its rank could not finish writing it) or of another format."""
    try:
        info = json.loads(path.read_text())["message"]["extraInfo"]
        int(info["timestamp"])
        return isinstance(info["py_callstack"], str)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def disk_full(path: Path) -> bool:
    """Whether the disk holding ``path`` has no space left: a rank there can write nothing, not even why it failed."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail == 0


def release_error_rooms(run_dir: Path, group: LaunchGroup) -> None:
    """Frees the space the group's ranks claimed for error files they never wrote: a rank killed
    before its end cannot free its own."""
    for rank in range(group.ranks):
        release_error_room(run_dir / group.error_file(rank))


def judge_failure(
    result: LaunchResult, context: LaunchContext, dumps: StackDumps | None, oom_kills_during: int = 0
) -> None:
    """Sets the verdict, headline and error of a group that ran out of time (``dumps``: what its
    deadline left) or else whose ranks failed (``result.failures``): its root cause, judged by
    triage.py. A group with neither is left as it is."""
    root = result.root
    if dumps is not None:
        result.verdict = Verdict(INFRASTRUCTURE, "timeout")
        result.headline, result.error = dumps.explain(result.group, context.timeout_s)
    elif root is not None:
        result.verdict = classify(root.exitcode, root.traceback, oom_kills_during, context.subject_source)
        result.headline, result.error = _explain_root_cause(result, root)


def _explain_root_cause(result: LaunchResult, root: RankFailure) -> tuple[str, str]:
    """(one line, full text): the root cause with its traceback, then its peers' endings as consequences;
    for bad input, the refusal's own line, which names the file and what is wrong with it."""
    if result.verdict.kind == BAD_INPUT:
        refusal, group = result.verdict.reason, result.group.name
        return refusal, f"rank {root.rank} of group '{group}' refused its input (log: {root.log}): {refusal}"
    how = result.verdict.reason if root.exitcode < 0 else f"{_ending(root.exitcode)}, {result.verdict.reason}"
    cause = root.message.strip().splitlines()[-1]
    headline = f"rank {root.rank} failed first ({how}): {cause}"
    lines = [f"rank {root.rank} of group '{result.group.name}' failed first ({how}; log: {root.log}): {cause}"]
    lines += ["    " + line for line in root.message.rstrip().splitlines()]
    others = [
        f"rank {f.rank} {_ending(f.exitcode)}" + (f" ({exception_line(f.traceback)[:160]})" if f.traceback else "")
        for f in result.failures
        if not f.root_cause
    ]
    if others:
        lines.append("then, as a consequence: " + "; ".join(others))
    return headline, "\n".join(lines)


def _ending(exitcode: int) -> str:
    if exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def log_tail(path: Path) -> str:
    """The last lines of a log, or "" where it cannot be read."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_LOG_TAIL_LINES:])
