"""Launching a run's groups of ranks: how a launch group ended, and the one interface
both launchers implement.

A run's arms are planned into launch groups (harness/plan.py), and the run hands each group in turn
to a ``GroupLauncher``: the elastic agent on this machine (``local.launch_group``) or a Slurm job
(``slurm.watch.JobWatch``). Every launcher starts ``python -m harness.rank RUN_DIR GROUP`` once
per rank, with the rank's output in ``LaunchGroup.log`` and its traceback in
``LaunchGroup.error_file``, and reports the ending as a ``LaunchResult``: the failed ranks in the
order they died, the root cause judged by triage.py (failures.py), or the deadline's stack dumps
(deadline.py). Nothing here imports the run that
calls it (harness/run.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.plan import LaunchGroup
from harness.triage import Verdict

# Once one rank failed, the seconds its peers get to fail on their own before the group is torn down.
SHUTDOWN_GRACE_S = 3


@dataclass
class RankFailure:
    """One rank that ended badly, as its launcher reported it and the time of its death ordered it."""

    rank: int
    exitcode: int  # negative: killed by that signal
    message: str  # a traceback where the rank left one, else how it ended
    log: str  # relative to the run directory
    traceback: str | None = None
    died_at: float | None = None  # seconds, on the clock its launcher timed deaths with
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
    job: dict[str, Any] | None = None  # the Slurm job that ran the group (slurm/watch.py): id, state, stderr

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def root(self) -> RankFailure | None:
        return next((f for f in self.failures if f.root_cause), None)


@dataclass(frozen=True)
class LaunchContext:
    """What every launch group of one run is launched with.

    ``deadline`` (monotonic seconds) and ``timeout_s`` (``--timeout``) bound the run's launches
    together (a Slurm job counts only its running time against ``timeout_s``, not its time in the
    queue); at the deadline the ranks dump their stacks, then die (deadline.py). ``env`` is
    exported to the ranks; ``tick`` (progress) is called every fraction of a second.
    ``subject_source`` is the code of the system under test (``Subject.source``): a rank raising
    through it is a regression, anywhere else infrastructure (triage.py).
    """

    run_dir: Path
    deadline: float
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    tick: Callable[[], None] = lambda: None
    subject_source: tuple[Path, ...] = ()


class GroupLauncher(Protocol):
    """Runs one launch group to its end and says how it ended: the elastic agent here (local.py) or
    a Slurm job (slurm/watch.py). Never raises for rank failures; ``Cancelled`` passes through once
    the ranks are gone."""

    def __call__(self, group: LaunchGroup, context: LaunchContext) -> LaunchResult: ...
