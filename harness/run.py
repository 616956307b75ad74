"""One ``harness run``: prepare -> launch -> read -> judge -> locate -> write, each one call.

Exit codes are the CI contract: 0 every check passed; 1 a check failed (a regression, a rank
raising from the system under test included, see triage.py); 2 bad usage, suite or input
(nothing was launched), or a checkpoint a resumed arm refused to load; 3 infrastructure (a rank
killed or hung, a timeout, a launch failure, an error in the harness itself: a flake, or a crash
to look at); 4 inconclusive (a throughput gate whose interval straddles its threshold: rerun with
more blocks); 128 + N cancelled by signal N.
Whatever happens after the run directory exists, summary.json, junit.xml and report.html are
written (in that order), partial records stay on disk, and the harness's own log, with any
traceback, is logs/harness.log.

| step | call | where |
| --- | --- | --- |
| prepare | validate, make the run directory, write manifest.json | :func:`harness.prepare.prepare_run` |
| launch | the launch groups, one after another, under one deadline | :func:`harness.launching.launch_run` |
| read | what the ranks recorded | ``run.kind.read`` (:mod:`harness.kinds`) |
| judge | the checks, the verdict | :func:`harness.judge.judge` |
| locate | the first op where a failed bit-level check's arms part | :func:`harness.first_op.locate_first_op` |
| write | the golden update, summary.json, junit.xml, report.html, the console | :func:`harness.outputs.write_outputs` |

``harness submit`` prepares the same way and launches as Slurm jobs; ``harness collect`` reads a
prepared run back (:func:`harness.prepare.read_prepared`); both then go through :func:`judge_run`.
"""

from __future__ import annotations

import sys
from typing import TextIO

from harness.cancel import Cancellation, Cancelled
from harness.first_op import locate_first_op
from harness.judge import judge
from harness.launchers import GroupLauncher
from harness.launchers.local import launch_group
from harness.launching import launch_run
from harness.outputs import write_outputs
from harness.prepare import PreparedRun, RunOptions, prepare_run
from harness.records import RunRecords
from harness.report.figures import import_in_background
from harness.rundir import harness_log
from harness.specs import SuiteSpec


def run_suite(suite: SuiteSpec, options: RunOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Runs a validated suite end to end on this machine and returns the exit code; raises
    UsageError or GoldenError (exit 2) before launching."""
    return judge_run(prepare_run(suite, options, out), launch_group, out, err)


def judge_run(run: PreparedRun, launch: GroupLauncher, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Launches a prepared run's groups with ``launch``, reads and judges what they recorded, and
    writes the outputs; returns the exit code: one path for every launcher."""
    import_in_background()  # the report's matplotlib, while the ranks run
    with harness_log(run.run_dir), Cancellation():
        launched = launch_run(run, launch, out, err)
        try:
            records = run.kind.read(run.run_dir)
        except Cancelled as c:  # the judge says so; the outputs are still written
            launched.cancelled, records = launched.cancelled or c, RunRecords()
        judgement = locate_first_op(run, launched, records, judge(run, launched, records), launch, out)
        return write_outputs(run, launched, records, judgement, out, err)
