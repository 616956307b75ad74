"""Cancellation: SIGINT or SIGTERM ends a run as Unix tools end, with exit code 128 + N.

The first signal raises ``Cancelled`` in the main thread, wherever it is (inside the elastic
agent too: the harness keeps SIGINT and SIGTERM for itself, see launchers/local.py). The run stops its
ranks, keeps every record they wrote, and still writes summary.json, junit.xml and report.html
with verdict ``cancelled``. A second signal means "now": the process exits at once with the first
signal's code, and the ranks die with it (PR_SET_PDEATHSIG).

``Cancelled`` is a BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the
way up can mistake a cancellation for a failure.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Cancelled(BaseException):
    """The run was cancelled by a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"cancelled by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Cancellation:
    """Signal handlers for one run, installed from the main thread."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __enter__(self) -> Cancellation:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            raise Cancelled(signum)
        print(f"\n{signal.Signals(signum).name} again: aborting at once", file=sys.stderr, flush=True)
        os._exit(128 + self.signum)
