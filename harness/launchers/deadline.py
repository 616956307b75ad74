"""A launch group at its deadline, alike under both launchers: every rank's Python stacks, then the kill.

A hung group says nothing of where it hangs, so before its ranks die each is asked for a
faulthandler dump of its threads' stacks (SIGUSR1, which the rank registers as it starts), and
the user is told which ranks' stacks are in their logs and which ranks left none (still starting
up, before the handler). How the signal and the kill reach the ranks is the launcher's: signals to
the local ranks' process groups (local.py), or ``scancel`` to every step of a Slurm job
(slurm/watch.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.plan import LaunchGroup

# Seconds to wait for the stack dumps after SIGUSR1, before killing hung ranks.
STACK_DUMP_WAIT_S = 3.0
_POLL_S = 0.05


@dataclass(frozen=True)
class StackDumps:
    """What the deadline left: the ranks whose Python stacks are in their logs (``dumped``), and
    those that left none (``silent``)."""

    dumped: list[int]
    silent: list[int]

    def explain(self, group: LaunchGroup, timeout_s: float) -> tuple[str, str]:
        """(one line, full text) of the group's timeout, naming where the stacks are."""
        stacks = f"ranks {self.dumped}: Python stacks dumped to {group.log('<k>')}" if self.dumped else ""
        none = f"ranks {self.silent}: no stack (still starting up, before the dump handler)" if self.silent else ""
        ranks = "; ".join(filter(None, [stacks, none]))
        text = f"group '{group.name}' timed out after --timeout {timeout_s:g}s; {ranks}"
        return text, text + "; the ranks were killed"


def dump_stacks_then_kill(
    run_dir: Path, group: LaunchGroup, dump: Callable[[], None], kill: Callable[[], None]
) -> StackDumps:
    """Calls ``dump`` (SIGUSR1 to every rank), waits until each rank log there was holds a new stack
    dump, at most STACK_DUMP_WAIT_S, then calls ``kill``; returns which ranks' logs gained one. Any
    other line a rank writes meanwhile is no stack: the wait is for the dump itself."""
    logs = {rank: run_dir / group.log(rank) for rank in range(group.ranks)}
    sizes = {rank: _size(log) for rank, log in logs.items()}
    present = [rank for rank, log in logs.items() if log.is_file()]  # a rank without a log has not started
    dump()
    give_up = time.monotonic() + STACK_DUMP_WAIT_S
    while time.monotonic() < give_up and not all(_stack_since(logs[rank], sizes[rank]) for rank in present):
        time.sleep(_POLL_S)
    kill()
    dumped = sorted(rank for rank, log in logs.items() if _stack_since(log, sizes[rank]))
    return StackDumps(dumped, sorted(set(logs) - set(dumped)))


def _stack_since(log: Path, offset: int) -> bool:
    """Whether a rank log holds a faulthandler stack dump past ``offset`` bytes."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return b"(most recent call first)" in f.read()
    except OSError:
        return False


def _size(log: Path) -> int:
    """The log's size in bytes; 0 for one not written yet."""
    try:
        return log.stat().st_size
    except OSError:
        return 0
