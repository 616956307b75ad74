"""What a run's checks add up to (harness/verdict.py): checks of arms a failed launch never ran are
errors "not evaluated", left out of the exit code; a negative suite passes only when exactly its
expected failures fail; a failed run is drift only when every failure is."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from harness.launchers import LaunchResult, RankFailure
from harness.plan import LaunchGroup
from harness.records import ArmRecords, read_metrics_records
from harness.report import format_verdict_table
from harness.report.checks import status_counts
from harness.results import BAD_INPUT, BASE_FAILS, CHANGE, CheckResult
from harness.subject.protocol import ArmFacts
from harness.suites import SuiteError
from harness.verdict import (
    DRIFT,
    EXIT_FAIL,
    EXIT_PASS,
    EXIT_USAGE,
    apply_expectations,
    conclude,
    label_line,
    mark_not_evaluated,
    run_label,
    unrun_arms,
    verdict_of,
)
from tests.suite_files import suite_from

NEGATIVE = """
name = "negative"
description = "two arms, one check expected to fail"
ranks = 1
steps = 2
expect = "fail"
expected_failures = {failures}

[arms.a]

[arms.b]

[[checks]]
kind = "exact"
arms = ["a", "b"]

[[checks]]
kind = "ranks-agree"
"""


def _check(name: str, status: str, arms: tuple[str, ...] = ("a",)) -> CheckResult:
    return CheckResult(name, "exact", status, f"{name} detail", arms=[*arms])


def _records(steps: int) -> ArmRecords:
    rows = [{"step": s, "loss": 1.0, "grad_norm": 1.0, "tokens": 8, "step_time_s": 0.1} for s in range(1, steps + 1)]
    return ArmRecords(metrics=read_metrics_records(rows, "<test>"))


def _failed(group: LaunchGroup, rank: int = 1) -> LaunchResult:
    root = RankFailure(rank, 1, "Traceback ...\nIndexError: index 9", "logs/rank1.log", root_cause=True)
    return LaunchResult(group, 1.0, error="rank 1 failed", headline="rank 1 failed first", failures=[root])


@pytest.fixture
def negative(tmp_path: Path):
    return suite_from(tmp_path, NEGATIVE.format(failures='["exact"]'))


def test_a_negative_suite_failing_exactly_as_expected_passes(negative) -> None:
    judged = apply_expectations(negative, [_check("exact", "fail"), _check("a: ranks-agree", "pass")])
    assert [c.status for c in judged] == ["xfail", "pass"]
    assert judged[0].detail == "failed as expected: exact detail"
    assert verdict_of(judged) == ("failed-as-expected", EXIT_PASS)


def test_a_negative_suite_whose_expected_failure_passes_fails(negative) -> None:
    (judged,) = apply_expectations(negative, [_check("exact", "pass")])
    assert judged.status == "fail" and judged.detail == "expected to fail, but passed: exact detail"
    assert verdict_of([judged]) == ("fail", EXIT_FAIL)


def test_a_negative_suite_with_another_failure_fails(negative) -> None:
    judged = apply_expectations(negative, [_check("exact", "fail"), _check("a: ranks-agree", "fail")])
    assert [c.status for c in judged] == ["xfail", "fail"]
    assert verdict_of(judged) == ("fail", EXIT_FAIL)


def test_an_expected_failure_no_check_produced_fails(tmp_path: Path) -> None:
    suite = suite_from(tmp_path, NEGATIVE.format(failures='["exact", "b: ranks-agree"]'))
    judged = apply_expectations(suite, [_check("exact", "fail"), _check("a: ranks-agree", "pass")])
    missing = judged[-1]
    assert (missing.name, missing.kind, missing.status) == ("expect: b: ranks-agree", "expect", "fail")
    assert missing.detail == "expected 'b: ranks-agree' to fail, but no check of that name ran (other failures: none)"
    assert verdict_of(judged) == ("fail", EXIT_FAIL)


def test_a_suite_expecting_to_pass_is_judged_as_it_ran(tmp_path: Path) -> None:
    suite = suite_from(tmp_path, NEGATIVE.replace('expect = "fail"\nexpected_failures = {failures}\n', ""))
    judged = apply_expectations(suite, [_check("exact", "fail")])
    assert [c.status for c in judged] == ["fail"]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('expect = "fail"', 'expected_failures: missing: expect = "fail" needs the checks that must fail'),
        ('expect = "maybe"', "expect: expected one of"),
        ('expect = "fail"\nexpected_failures = []', "expected_failures: expected a non-empty list of check names"),
        ('expected_failures = ["exact"]', 'expected_failures: only a suite with expect = "fail"'),
    ],
)
def test_bad_expectations_name_the_field(tmp_path: Path, lines: str, message: str) -> None:
    text = NEGATIVE.replace('expect = "fail"\nexpected_failures = {failures}', lines)
    with pytest.raises(SuiteError, match=message.replace("(", r"\(")):
        suite_from(tmp_path, text)


def test_checks_of_arms_a_failed_launch_never_ran_are_not_evaluated(tmp_path: Path) -> None:
    """Group one ran a, then failed in b (which recorded nothing); group two never started."""
    first, second = LaunchGroup("a+b", 2, ("a", "b"), "logs"), LaunchGroup("c", 1, ("c",), "logs/c")
    records = {"a": _records(2), "b": _records(0), "c": _records(0)}
    unrun = unrun_arms(
        suite_from(tmp_path, NEGATIVE.format(failures='["exact"]')), [first, second], [_failed(first)], records
    )
    assert unrun == {
        "b": "launch a+b failed (root cause: rank 1)",
        "c": "launch c never started: launch a+b failed (root cause: rank 1)",
    }
    checks = [_check("a vs b", "fail", ("a", "b")), _check("a: agree", "pass"), _check("c: agree", "fail", ("c",))]
    marked = mark_not_evaluated(checks, unrun)
    assert [c.status for c in marked] == ["error", "pass", "error"]
    assert marked[0].detail == "not evaluated: arm 'b' never ran: launch a+b failed (root cause: rank 1)"
    # The launch's own check decides the exit code: a rank that raised is a regression, never a flake.
    raised = CheckResult("rank 1 raised", "rank-raised", "fail", "rank 1 failed first")
    assert verdict_of([raised, *marked]) == ("fail", EXIT_FAIL)
    assert verdict_of(marked) == ("pass", 0) != verdict_of([*marked, _check("x", "error")])
    counts = status_counts([c.to_dict() for c in [raised, *marked]])
    assert (counts["fail"], counts["error"], counts["not_evaluated"]) == (1, 2, 2)


def test_a_refused_checkpoint_is_bad_input_and_its_arm_never_ran(tmp_path: Path) -> None:
    """A resumed arm recorded steps in its first launch; its second refused the checkpoint before
    training: its checks are not evaluated, and bad input decides the verdict over their failures."""
    loading = LaunchGroup("r@3-", 1, ("a",), "logs/r@3-", first_step=3, checkpoint="load")
    suite = suite_from(tmp_path, NEGATIVE.format(failures='["exact"]'))
    unrun = unrun_arms(suite, [loading], [_failed(loading)], {"a": _records(2), "b": _records(4)})
    assert unrun == {"a": "launch r@3- failed (root cause: rank 1)"}
    loaded = ArmRecords(metrics=_records(2).metrics, facts=ArmFacts(resumed_from=2))  # it loaded, then failed
    assert unrun_arms(suite, [loading], [_failed(loading)], {"a": loaded, "b": _records(4)}) == {}
    refused = CheckResult("bad input: r@3-", BAD_INPUT, "error", "step-2/__0_0.distcp: missing: ...")
    assert verdict_of([refused, _check("a vs b", "fail", ("a", "b"))]) == (BAD_INPUT, EXIT_USAGE)


def test_every_launch_ok_leaves_every_check_evaluated(tmp_path: Path) -> None:
    group = LaunchGroup("a+b", 2, ("a", "b"), "logs")
    records = {"a": _records(2), "b": _records(0)}
    suite = suite_from(tmp_path, NEGATIVE.format(failures='["exact"]'))
    assert unrun_arms(suite, [group], [LaunchResult(group, 1.0)], records) == {}


def test_the_console_folds_checks_not_evaluated_into_one_row() -> None:
    unrun = {"b": "launch a+b failed (root cause: rank 1)"}
    checks = mark_not_evaluated([_check("b: x", "fail", ("b",)), _check("b: y", "fail", ("b",))], unrun)
    raised = CheckResult("rank 1 raised", "rank-raised", "fail", "rank 1 failed first")
    summary = {"suite": "s", "verdict": "fail", "exit_code": 1, "checks": [c.to_dict() for c in [raised, *checks]]}
    lines = format_verdict_table(summary).splitlines()
    assert lines[1].split() == ["FAIL", "rank", "1", "raised", "rank", "1", "failed", "first"]
    assert lines[2].split() == ["ERROR", "2", "checks", "not", "evaluated", "arms", "'b':", "never", "ran"]
    assert lines[-1] == "0 passed, 1 failed, 2 errors (2 not evaluated), 0 skipped"


def test_every_failure_is_a_regression_unless_its_family_labelled_it_drift() -> None:
    drift = dataclasses.replace(_check("golden:a:loss", "fail"), label=DRIFT)
    expected = dataclasses.replace(_check("b: agree", "xfail"), label=DRIFT)  # a negative suite's: not judged
    checks, verdict, code = conclude([drift, _check("a vs b", "fail"), _check("a: agree", "pass"), expected], None, 1.0)
    assert (verdict, code) == ("fail", EXIT_FAIL)  # drift never merges silently
    assert [c.label for c in checks] == ["drift", "regression", None, None]
    assert run_label(checks, verdict) == "regression"
    assert (
        label_line(checks, "regression", "unused")
        == "regression: 1 failed check: a vs b (1 more failed as drift: see their rows)"
    )
    checks, verdict, code = conclude([drift, _check("a: agree", "pass")], None, 1.0)
    assert (run_label(checks, verdict), code) == ("drift", EXIT_FAIL)
    assert run_label(checks, "error") is None  # an error or a cancellation is not judged drift or regression


def test_a_change_failure_labels_the_run_change_unless_a_regression_fails_too() -> None:
    changed = dataclasses.replace(_check("a: head vs base: loss", "fail"), label=CHANGE)
    at_base = dataclasses.replace(_check("a: agree", "fail"), label=BASE_FAILS)
    checks, verdict, _ = conclude([changed, at_base], None, 1.0)
    assert run_label(checks, verdict) == "change"
    assert label_line(checks, "change", "unused") == "change: 1 failed check: a: head vs base: loss"
    checks, verdict, _ = conclude([at_base, _check("b: ok", "pass")], None, 1.0)
    assert run_label(checks, verdict) == "base"  # the base fails it too: not blamed on the change
    assert label_line(checks, "base", "unused").startswith("base: 1 failed check fail at the base too")
    checks, verdict, _ = conclude([changed, _check("a vs b", "fail")], None, 1.0)
    assert run_label(checks, verdict) == "regression"


SUBJECT_BUG_IN_PIPELINED = """
import harness.reference.pec as pec

planned = pec.schedule


def schedule(config):
    if config.pec == "pipelined":
        raise KeyError("after_backward")
    return planned(config)


pec.schedule = schedule
"""


def test_a_rank_raising_in_one_arm_leaves_the_later_arms_not_evaluated(run_harness, plant, tmp_path: Path) -> None:
    """PEC's pipelined arm raises from the system under test as it is built: the sequential arm's
    checks are judged, every check reading an arm that never ran is not evaluated, and the run is a
    regression (exit 1), not the six "recorded no PEC events" failures of each later arm."""
    out = tmp_path / "run"
    args = ("--ranks", 2, "--steps", 2, "--golden", "off", "--out", out)
    run = run_harness("run", "pec", *args, env=plant(SUBJECT_BUG_IN_PIPELINED))
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.summary(out)
    by_status: dict[str, set[str]] = {}
    for check in summary["checks"]:
        by_status.setdefault(check["status"], set()).add(check["name"])
    (raised,) = by_status["fail"]  # every rank raises: whichever dies first is the root cause
    assert re.fullmatch(r"rank [01] raised", raised), by_status["fail"]
    assert by_status["pass"] and all(name.startswith("sequential: ") for name in by_status["pass"])
    unrun = [c for c in summary["checks"] if c["status"] == "error"]
    assert unrun and all(c["detail"].startswith("not evaluated: arm '") for c in unrun)
    assert {c["extra"]["not_evaluated"] for c in unrun} == {"pipelined", "chunked-sequential", "chunked-pipelined"}
    assert summary["counts"]["not_evaluated"] == len(unrun) == summary["counts"]["error"]
    assert f"ERROR  {len(unrun)} checks not evaluated" in run.stdout
