"""Judging a launched run: what its ranks recorded, checked (:func:`judge`).

In order: each failed launch group (a rank that raised from the system under test is a
regression, anything else infrastructure: triage.py), the records themselves (unreadable, short,
or off the pinned kernel ISA), then every check through its family (harness/checks/): the suite's
[[checks]] and the golden's, which no suite lists; a throughput run has its ABBA gate instead.
Checks of arms that never ran are not evaluated; a negative suite's expected failures are marked
as such (verdict.py). Then the verdict, the exit code and a failed run's label (drift or
regression). Judging writes nothing: the new golden of ``--golden update`` is written with the
run's other outputs (outputs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from harness.cancel import Cancelled
from harness.change import judge_change
from harness.checks import run_check
from harness.environment import CpuPin
from harness.launchers import LaunchResult
from harness.launching import Launched
from harness.plan import LaunchGroup, expected_raise
from harness.prepare import PreparedRun
from harness.records import ArmRecords, RunRecords
from harness.results import BAD_INPUT, REGRESSION, CheckResult
from harness.revisions import Revision
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.triage import raised_exception
from harness.verdict import apply_expectations, conclude, label_line, mark_not_evaluated, run_label, unrun_arms

log = logging.getLogger("harness")
EXPECT_RAISE = "expect-raise"  # the kind of an arm expected to raise's check (expected_raise_check)


@dataclass(frozen=True)
class Judgement:
    """The run's checks, its verdict and exit code, and what became of its golden: the line
    summary.json keeps (``golden_outcome``) and what the console prints after the verdict (an
    update's, once outputs.py has written it). A failed
    run's label, drift or regression, and its line, the console's last (None unless it failed)."""

    checks: list[CheckResult]
    verdict: str
    exit_code: int
    golden_outcome: str | None
    golden_news: str | None
    label: str | None = None
    label_line: str | None = None
    change_line: str | None = None  # a change check's opening line (harness/change.py); None for any other run


def judge(run: PreparedRun, launched: Launched, records: RunRecords) -> Judgement:
    """The checks of what ``launched`` left, the verdict, and how the golden compared. A signal
    while judging cancels the run (its checks are then unknown); an error of the harness is one
    internal-error check. Nothing is written here: a ``--golden update`` is the outputs' (outputs.py)."""
    cancelled, checks, change = launched.cancelled, [], None
    try:
        if cancelled is None:
            with run.phases.phase("judge"):
                checks, change = _checks(run, launched, records)
    except Cancelled as c:
        cancelled = c
    except Exception as e:
        log.exception("internal error while judging the suite")
        checks = [CheckResult("harness", "internal-error", "error", f"internal error: {type(e).__name__}: {e}")]
    checks, verdict, exit_code = conclude(checks, cancelled, launched.elapsed_s())
    label = run_label(checks, verdict)
    line = label_line(checks, label, run.rebless)
    news = run.golden.outcome(checks)
    outcome = news.splitlines()[-1] if news else None
    return Judgement(checks, verdict, exit_code, outcome, news, label, line, change)


def _checks(run: PreparedRun, launched: Launched, records: RunRecords) -> tuple[list[CheckResult], str | None]:
    """The checks, and a change check's opening line (None for any other run)."""
    if launched.internal_error:
        return [CheckResult("harness", "internal-error", "error", launched.internal_error)], None
    revisions = run.manifest.revisions
    return collect_checks(run.suite, run.checks, run.groups, launched.results, records, run.pin, revisions)


def launch_checks(launches: list[LaunchResult], arms: Mapping[str, ArmSpec]) -> list[CheckResult]:
    """A failed launch group as a check: "rank k raised" (a regression) when its root cause raised
    from the system under test, "bad input" when it refused a checkpoint (its line names the file),
    else an infrastructure error. The launch of an arm expected to raise is judged by
    :func:`expected_raise_check`, whether it failed or not."""
    checks = []
    for r in launches:
        if (text := expected_raise(r.group, arms)) is not None:
            checks.append(expected_raise_check(r, r.group.arms[0], text))
            continue
        if r.ok:
            continue
        if r.verdict is not None and r.verdict.kind == BAD_INPUT:
            checks.append(CheckResult(f"bad input: {r.group.name}", BAD_INPUT, "error", r.headline))
        elif r.verdict is not None and r.verdict.kind == REGRESSION:
            root = r.root
            extra = {"traceback": root.traceback, "log": root.log, "error": r.error}
            checks.append(CheckResult(f"rank {root.rank} raised", "rank-raised", "fail", r.headline, extra=extra))
        else:
            checks.append(
                CheckResult(f"launch: {r.group.name}", "launch", "error", r.headline, extra={"error": r.error})
            )
    return checks


def expected_raise_check(r: LaunchResult, arm: str, text: str) -> CheckResult:
    """ "ARM: raises": an expected failure (xfail) when a rank raised from the system under test with
    ``text`` in its exception's line; a failure when it ran every step (the system under test no
    longer raises there: the suite must say so) or raised something else; an infrastructure error
    stays one."""
    name, expected = f"{arm}: raises", f"expected to raise {text!r}"
    if r.ok:
        return CheckResult(name, EXPECT_RAISE, "fail", f"{expected}, but ran every step: drop expect_raise", arms=[arm])
    if r.verdict is None or r.verdict.kind != REGRESSION:
        return CheckResult(f"launch: {r.group.name}", "launch", "error", r.headline, extra={"error": r.error})
    extra = {"traceback": r.root.traceback, "log": r.root.log, "error": r.error}
    raised = raised_exception(r.root.traceback)
    where = f"rank {r.root.rank}, {r.verdict.reason}"
    if text in raised:
        detail = f"raised as expected ({where}): {raised.splitlines()[0]}"
        return CheckResult(name, EXPECT_RAISE, "xfail", detail, extra=extra, arms=[arm])
    detail = f"{expected}, raised instead ({where}): {raised}"
    return CheckResult(name, EXPECT_RAISE, "fail", detail, extra=extra, arms=[arm])


def record_checks(
    suite: SuiteSpec, records: Mapping[str, ArmRecords], pin: CpuPin | None, crashed: bool
) -> list[CheckResult]:
    """Unreadable records, arms that stopped short though no rank failed, and ranks that did not
    run on the pinned kernel ISA."""
    checks = [
        CheckResult(f"records: {arm}", "records", "error", rec.error) for arm, rec in records.items() if rec.error
    ]
    for arm, rec in records.items():
        if not crashed and not rec.error and rec.steps_done() != suite.steps:
            detail = f"arm '{arm}' recorded {rec.steps_done()} of {suite.steps} steps, and no rank failed"
            checks.append(CheckResult(f"records: {arm}", "records", "fail", detail))
    if pin is not None and pin.pinned:
        for arm, rec in records.items():
            if rec.cpu_capability not in (None, pin.capability):
                detail = f"arm '{arm}' ran on {rec.cpu_capability} kernels, not the pinned {pin.capability}"
                checks.append(CheckResult(f"cpu-isa: {arm}", "cpu-isa", "error", detail))
    return checks


def collect_checks(
    suite: SuiteSpec,
    planned: list[CheckSpec],
    groups: list[LaunchGroup],
    launches: list[LaunchResult],
    records: RunRecords,
    pin: CpuPin | None,
    revisions: dict[str, Revision] | None = None,
) -> tuple[list[CheckResult], str | None]:
    """Rank failures first, then the records, then the planned checks (the suite's and the
    golden's), all on whatever the arms recorded: a check never passes on steps that did not run,
    and a check of an arm that a failed launch never ran is not evaluated (verdict.py). A change
    check's results are judged as a change (``revisions``: harness/change.py), with its opening line."""
    failures = launch_checks(launches, suite.arms)
    recorded = record_checks(suite, records, pin, crashed=bool(failures))
    checks, change = _run(planned, suite, records), None
    if revisions:
        checks, change = judge_change(checks, planned, suite, records, revisions, launched=not failures)
    # An arm that raised as expected has nothing to judge: its "raises" row stands for its checks.
    raised = {c.arms[0] for c in failures if c.kind == EXPECT_RAISE and c.status == "xfail"}
    checks = [c for c in checks if not raised.intersection(c.arms)]
    checks = mark_not_evaluated([*recorded, *checks], unrun_arms(suite, groups, launches, records))
    return [*failures, *apply_expectations(suite, checks)], change


def _run(planned: list[CheckSpec], suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    """The planned checks, each on the arms it names: the suite's own and its golden's name the arms
    the suite was written with (a change check's head arms), its ``change`` checks both sides."""
    return [result for check in planned for result in run_check(check, suite, records)]
