"""Launching a run's groups of ranks: what a launch group is, how it ended, and the one interface
both launchers implement.

A run's arms are planned into launch groups (``plan_launches``; a throughput run plans its own,
harness/throughput.py), and the run hands each group in turn to a ``GroupLauncher``: the elastic
agent on this machine (``local.launch_group``) or a Slurm job (``slurm.watch.JobWatch``). Every
launcher starts ``python -m harness.worker RUN_DIR GROUP`` once per rank, with the rank's output in
``LaunchGroup.log`` and its traceback in ``LaunchGroup.error_file``, and reports the ending as a
``LaunchResult``: the failed ranks in the order they died, the root cause judged by triage.py
(failures.py), or the deadline's stack dumps (deadline.py). Nothing here imports the run that
calls it (harness/run.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from harness.rundir import LOGS_DIR
from harness.specs import SuiteSpec
from harness.triage import Verdict

# Once one rank failed, the seconds its peers get to fail on their own before the group is torn down.
SHUTDOWN_GRACE_S = 3


@dataclass(frozen=True)
class LaunchGroup:
    """Arms sharing a process count: they run in one launch, one after another. A throughput
    run's group instead times the block positions in ``measurements`` (harness/throughput.py).
    A resumed arm's two launches are groups apart from the straight arms' (shared with resumed arms
    that stop and resume alike): ``first_step`` to ``last_step`` (None: the suite's last), the
    first ending with a save (``checkpoint = "save"``), the second starting with a load (``"load"``).
    An op-recording re-run's groups (harness/first_op.py) set ``record_ops``: every rank records its
    ops, and keeps the outputs of the op ``capture_ops`` names for it, as (arm, process rank, op index)."""

    name: str
    ranks: int
    arms: tuple[str, ...]
    log_dir: str  # relative to the run directory
    measurements: tuple[Any, ...] = ()  # harness.throughput.Measurement
    first_step: int = 1
    last_step: int | None = None
    checkpoint: str | None = None
    record_ops: bool = False
    capture_ops: tuple[tuple[str, int, int], ...] = ()

    def log(self, rank: int) -> str:
        return f"{self.log_dir}/rank{rank}.log"

    def error_file(self, rank: int) -> str:
        """Where the rank writes its traceback (TORCHELASTIC_ERROR_FILE), relative to the run directory."""
        return f"{self.log_dir}/rank{rank}.error.json"


def plan_launches(suite: SuiteSpec) -> list[LaunchGroup]:
    """Groups arms by process count, keeping the suite's arm order; then the resumed arms' saving
    launches, then their loading ones. Resumed arms that save on the same process count after the
    same step share their saving launch, and so for loading: their arms run in turn in it, as in
    any group, and a launch's start-up (seconds) is paid once."""
    by_ranks: dict[int, list[str]] = {}
    saving: dict[tuple[int, int], list[str]] = {}
    loading: dict[tuple[int, int], list[str]] = {}
    for arm in suite.arms.values():
        if arm.resume_at is None:
            by_ranks.setdefault(arm.ranks, []).append(arm.name)
        else:
            saving.setdefault((arm.ranks, arm.resume_at), []).append(arm.name)
            loading.setdefault((arm.resume_ranks or arm.ranks, arm.resume_at), []).append(arm.name)
    single = len(by_ranks) == 1 and not saving
    groups = [
        LaunchGroup("+".join(arms), ranks, tuple(arms), LOGS_DIR if single else f"{LOGS_DIR}/{'+'.join(arms)}")
        for ranks, arms in by_ranks.items()
    ]
    for (ranks, at), arms in saving.items():
        name = f"{'+'.join(arms)}@1-{at}"
        groups.append(LaunchGroup(name, ranks, tuple(arms), f"{LOGS_DIR}/{name}", last_step=at, checkpoint="save"))
    for (ranks, at), arms in loading.items():
        name = f"{'+'.join(arms)}@{at + 1}-"
        groups.append(LaunchGroup(name, ranks, tuple(arms), f"{LOGS_DIR}/{name}", first_step=at + 1, checkpoint="load"))
    return groups


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
