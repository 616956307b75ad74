"""Loading a suite under the run's ``--timeout``.

Loading a suite runs its subject's own code in the harness process: the import of its module, its
factory and its ``parse_arms``. That is before any launch, where the launch deadline
(harness/launchers/deadline.py) does not reach, so a factory that hangs would hang the harness,
silently. Loading therefore runs on a thread of its own, given the run's whole ``--timeout``; at
the deadline the harness reports where that thread hangs as it reports a hung rank: one line naming
the file:line of its innermost frame, and its whole Python stack in a file the line names (no run
directory exists yet). The exit code is 3, infrastructure, as for a hung rank: a hang may be the
machine's (a network file system, a lock), and the stack tells which.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class LoadTimeout(Exception):
    """Loading ran past its deadline; one line naming where it hangs and the file holding its stack (exit 3)."""


def load_within(timeout_s: float, what: str, load: Callable[[], T]) -> T:
    """``load()``, run on a daemon thread and waited for at most ``timeout_s`` seconds; what it raises is
    raised here. At the deadline: LoadTimeout naming ``what``, where it hangs and where its stack is.
    The thread is left to the process's exit (a thread cannot be killed)."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, load()))
        except BaseException as e:  # handed to the caller's thread, which decides
            outcome.append((False, e))

    thread = threading.Thread(target=run, name=f"loading {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise LoadTimeout(_hang(thread, what, timeout_s))
    ok, value = outcome[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


def _hang(thread: threading.Thread, what: str, timeout_s: float) -> str:
    """The line of a load that hangs: its innermost frame, and a file with its whole stack."""
    frame = sys._current_frames().get(thread.ident)
    stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
    with tempfile.NamedTemporaryFile("w", prefix="harness-loading-", suffix=".log", delete=False) as f:
        f.write(f"{what}: still loading after --timeout {timeout_s:g}s; its thread's stack (most recent call last):\n")
        f.writelines(stack.format())
    where = f"hangs at {stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else "left no stack"
    return f"{what}: still loading after --timeout {timeout_s:g}s, {where} (stack: {Path(f.name)})"
