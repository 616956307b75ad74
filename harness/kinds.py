"""The two kinds of run a suite makes, one object each, so that no stage of a run asks which kind it is:

- a training run (:class:`TrainingRun`): every arm trained for the suite's steps, recorded step by
  step (``arms/<arm>/``), judged by the suite's [[checks]] and its golden, live progress per arm;
- a throughput run (:class:`ThroughputRun`, a suite's ``[throughput]`` table or ``harness abba``):
  two arms timed in ABBA blocks (harness/throughput.py), one row per block position in
  ``throughput.jsonl``, judged by the gate alone; it has no golden, and with ``blocks = "auto"`` it
  may stop between launches.

:func:`run_kind` picks one for a suite, and the prepared run keeps it (harness/prepare.py). The
rank side needs no kind: a throughput run's launch groups carry their block positions
(``LaunchGroup.measurements``), and that is what a rank reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from harness.checks.golden import golden_check
from harness.checks.throughput import gate_check
from harness.golden_plan import GoldenPlan
from harness.plan import LaunchGroup, plan_launches, plan_measurements, plan_throughput_launches
from harness.progress import BlockProgress, Progress
from harness.records import RecordError, RunRecords, read_arm, read_jsonl
from harness.rundir import THROUGHPUT, arm_files
from harness.specs import CheckSpec, SuiteSpec, ThroughputSpec
from harness.throughput import stop_reason


class TrainingRun:
    """Arms trained and recorded step by step, judged by the suite's checks and its golden."""

    records_golden = True

    def __init__(self, suite: SuiteSpec) -> None:
        self.suite = suite
        self.steps = suite.steps  # per arm

    def launches(self) -> list[LaunchGroup]:
        return plan_launches(self.suite)

    def checks(self, golden: GoldenPlan, groups: list[LaunchGroup]) -> list[CheckSpec]:
        """The suite's [[checks]] and the golden's (none when ``--golden update`` records it instead)."""
        return [*self.suite.checks, *filter(None, [golden_check(golden, self.suite)])]

    def progress(self, run_dir: Path, groups: list[LaunchGroup], out: TextIO, verbose: bool) -> Progress:
        """Per arm, in the order the groups run them: step k of N and the loss."""
        metrics = {arm: arm_files(run_dir, arm).metrics for group in groups for arm in group.arms}
        return Progress(metrics, self.suite.steps, out, verbose)

    def measured_enough(self, run_dir: Path, group: LaunchGroup) -> bool:
        """Never: every group of a training run runs."""
        return False

    def read(self, run_dir: Path) -> RunRecords:
        """Each arm's files, as complete as the run left them; nothing unreadable raises."""
        return RunRecords({arm: read_arm(run_dir, arm, spec.logical_ranks) for arm, spec in self.suite.arms.items()})

    def reported_arms(self, records: RunRecords) -> dict[str, dict[str, int]]:
        """The summary's arms: those that left records, with how many steps each completed."""
        arms = self.suite.arms
        return {
            arm: {"ranks": arms[arm].ranks, "ep": arms[arm].logical_ranks, "steps_completed": records[arm].steps_done()}
            for arm in arms
            if arm in records
        }


class ThroughputRun:
    """A against B in ABBA blocks, judged by the gate alone: no golden, no per-step records."""

    records_golden = False

    def __init__(self, suite: SuiteSpec, spec: ThroughputSpec) -> None:
        self.suite, self.spec = suite, spec
        self.steps = spec.steps  # per block position

    def launches(self) -> list[LaunchGroup]:
        return plan_throughput_launches(self.suite)

    def checks(self, golden: GoldenPlan, groups: list[LaunchGroup]) -> list[CheckSpec]:
        """The gate, whose stop rule depends on whether block positions are launches of their own."""
        return [gate_check(self.spec, groups)]

    def progress(self, run_dir: Path, groups: list[LaunchGroup], out: TextIO, verbose: bool) -> BlockProgress:
        """Per ABBA role: the blocks measured and the ratio so far."""
        spec = self.spec
        roles = {"A": spec.a, "B": spec.b, **({"control": spec.a} if spec.control else {})}
        return BlockProgress(run_dir / THROUGHPUT, roles, spec.planned_blocks, out, verbose, spec.adaptive)

    def measured_enough(self, run_dir: Path, group: LaunchGroup) -> bool:
        """Whether a run of separate launches may stop after ``group`` (harness/throughput.py's stop
        rule; a run in shared processes stops inside its one launch)."""
        if not self.spec.adaptive or len(group.measurements) == len(plan_measurements(self.spec)):
            return False
        return stop_reason(self.spec, read_jsonl(run_dir / THROUGHPUT)) is not None

    def read(self, run_dir: Path) -> RunRecords:
        """The block rows, or why they cannot be read."""
        path = run_dir / THROUGHPUT
        try:
            return RunRecords(throughput=read_jsonl(path) if path.is_file() else [])
        except RecordError as e:
            return RunRecords(throughput_error=str(e))

    def reported_arms(self, records: RunRecords) -> dict[str, dict[str, int]]:
        """The summary's arms: A and B."""
        timed = (self.spec.a, self.spec.b)
        return {arm: {"ranks": s.ranks, "ep": s.logical_ranks} for arm, s in self.suite.arms.items() if arm in timed}


RunKind = TrainingRun | ThroughputRun


def run_kind(suite: SuiteSpec) -> RunKind:
    """The kind of run ``suite`` makes: a throughput run where it has a [throughput] table."""
    return ThroughputRun(suite, suite.throughput) if suite.throughput else TrainingRun(suite)
