"""An arm the system under test is known to raise in (``expect_raise`` in its arm table): it runs in a
launch of its own, its raise reads XFAIL while the text matches, and it fails the run when the system
under test stops raising or raises something else (harness/judge.py, harness/plan.py). A real run of
it, the other launches going on and the raising arm's checks left out: tests/e2e/test_torchtitan_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.judge import expected_raise_check
from harness.launchers import LaunchResult, RankFailure
from harness.plan import LaunchGroup, joined, plan_launches
from harness.results import REGRESSION
from harness.suites import SuiteError
from harness.triage import INFRASTRUCTURE, Verdict, raised_exception
from tests.suite_files import suite_from

RAISING = """
name = "raising"
description = "two arms, one known to raise"
ranks = 1
steps = 2

[arms.a]

[arms.b]
{b}

[[checks]]
kind = "exact"
arms = ["a", "b"]
"""
# What a rank leaves when torchtitan's graph chunk pass raises: the message runs over many lines.
TRACEBACK = """Traceback (most recent call last):
  File "/site-packages/torchtitan/experiments/graph_trainer/ep_chunk_pass.py", line 2301, in lint
    raise RuntimeError(
RuntimeError: Argument 'sym_size_int_32' of Node 'view_216' was used before it has been defined!
graph():
    %arg0_1 : [num_users=1] = placeholder[target=arg0_1]
    return [arg0_1]
"""
GROUP = LaunchGroup("b", 1, ("b",), "logs/b")
SUBJECT = Verdict(REGRESSION, "raised in the system under test (ep_chunk_pass.py)")


def _raised(traceback: str, verdict: Verdict = SUBJECT) -> LaunchResult:
    root = RankFailure(1, 1, traceback, "logs/b/rank1.log", traceback=traceback, root_cause=True)
    return LaunchResult(
        GROUP, 1.0, error="rank 1 failed", headline="rank 1 failed first", failures=[root], verdict=verdict
    )


def test_an_arm_expected_to_raise_has_a_launch_of_its_own(tmp_path: Path) -> None:
    suite = suite_from(tmp_path, RAISING.format(b='expect_raise = "used before"'))
    assert suite.arms["b"].expect_raise == "used before" and suite.arms["a"].expect_raise is None
    assert [g.arms for g in plan_launches(suite)] == [("a",), ("b",)]
    plain = suite_from(tmp_path, RAISING.format(b=""))
    assert [g.arms for g in plan_launches(plain)] == [("a", "b")]


@pytest.mark.parametrize(
    "line, message",
    [
        ('expect_raise = ""', "arms.b.expect_raise: expected a non-empty string"),
        ('expect_raise = "  "', "arms.b.expect_raise: empty: name the text"),
        ("expect_raise = 3", "arms.b.expect_raise: expected a non-empty string"),
    ],
)
def test_a_bad_expect_raise_names_the_field(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(SuiteError, match=message):
        suite_from(tmp_path, RAISING.format(b=line))


def test_the_raise_is_an_expected_failure_only_while_its_text_matches() -> None:
    check = expected_raise_check(_raised(TRACEBACK), "b", "was used before it has been defined")
    assert (check.name, check.status, check.arms) == ("b: raises", "xfail", ["b"])
    assert check.detail == (
        "raised as expected (rank 1, raised in the system under test (ep_chunk_pass.py)): RuntimeError: Argument"
        " 'sym_size_int_32' of Node 'view_216' was used before it has been defined!"
    )
    other = expected_raise_check(_raised(TRACEBACK), "b", "expected m1 and m2 to have the same dtype")
    assert other.status == "fail" and "raised instead" in other.detail and "sym_size_int_32" in other.detail
    # The text is looked for in the exception only, not in the frames above it.
    assert expected_raise_check(_raised(TRACEBACK), "b", "ep_chunk_pass.py").status == "fail"


def test_an_arm_that_stops_raising_fails_and_an_infrastructure_error_stays_one() -> None:
    fixed = expected_raise_check(LaunchResult(GROUP, 1.0), "b", "used before")
    assert (fixed.status, fixed.detail) == (
        "fail",
        "expected to raise 'used before', but ran every step: drop expect_raise",
    )
    flake = expected_raise_check(_raised("Connection reset by peer", Verdict(INFRASTRUCTURE, "gloo")), "b", "x")
    assert (flake.name, flake.status) == ("launch: b", "error")


def test_the_exception_of_a_traceback_keeps_its_every_line() -> None:
    raised = raised_exception(TRACEBACK)
    assert raised.splitlines()[0].startswith("RuntimeError: Argument 'sym_size_int_32'")
    assert raised.endswith("return [arg0_1]") and "raise RuntimeError(" not in raised


def test_a_launch_of_many_arms_is_named_so_that_its_folder_fits() -> None:
    few = [f"versioned-resharded-{i}" for i in range(8)]  # 8 arms, 175 bytes: a folder's name as it is
    assert joined(few) == "+".join(few)
    many = [f"eager-traced-ep2-block-learned-{i}" for i in range(12)]
    assert joined(many) == "eager-traced-ep2-block-learned-0+11-more"
