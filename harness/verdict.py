"""What a run's checks add up to: the verdict and the exit code, and the two facts about a check that
its own family cannot know.

* **Not evaluated.** A launch group whose rank failed ends the run, so its later arms, and every
  group after it, never train. Their checks would fail on absent records ("recorded no PEC
  events") and read like regressions of their own. They are errors marked ``not_evaluated``: never
  a pass, counted apart, and left out of the exit code, which the launch's own check decides.
* **Cancelled.** A signal ends a run with verdict ``cancelled`` and exit code 128 + N, whatever
  its checks said; one more check says what stopped it and when (:func:`conclude`).
* **Expected failures.** A negative suite (``expect = "fail"``, such as ``pec-legacy``) proves that
  a check catches what it exists for. It passes when exactly its ``expected_failures`` fail, each
  then ``xfail``, and everything else passes; an expected failure that passes, or never ran, fails
  the run, and so does any other failure, as pytest's strict xfail does.

* **Drift or regression.** Every failed check is labelled. ``drift``: the environment moved the
  numbers, not the code; only the golden check says so (checks/golden.py: its own tier fails, the
  cross-environment tier passes, and the environment's fingerprint differs from the golden's),
  and the remedy is to re-record the golden. Any other failure is a ``regression``. The run's label
  is drift only when every failure is; the exit code is 1 either way, so drift never merges
  silently.

* **Bad input.** A rank that refused its input (a checkpoint that must not be loaded: triage.py)
  makes the run's verdict ``bad-input``, exit 2, whatever else its checks say: what ran after it
  never ran, and fixing the input comes before judging anything.

Exit codes (docs/architecture.md, "Verdict and exit codes"; docs/exit-codes.md): 0 pass, 1 a check failed,
2 bad input, 3 an error, 4 inconclusive.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from harness.cancel import Cancelled
from harness.checks.golden import drift_line
from harness.records import ArmRecords
from harness.results import (
    BAD_INPUT,
    BASE_FAILS,
    CHANGE,
    DRIFT,
    FAILED_AS_EXPECTED,
    NOT_EVALUATED,
    REGRESSION,
    CheckResult,
)
from harness.specs import SuiteSpec

if TYPE_CHECKING:  # the reports read verdicts too, without the launcher's imports
    from harness.launchers import LaunchResult
    from harness.plan import LaunchGroup

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INFRA, EXIT_INCONCLUSIVE = 0, 1, 2, 3, 4


def is_not_evaluated(check: CheckResult) -> bool:
    """Whether a check judged an arm that never ran (report/checks.py reads the same of a
    summary.json check)."""
    return bool(check.extra.get(NOT_EVALUATED))


def verdict_of(checks: list[CheckResult]) -> tuple[str, int]:
    """The run's verdict and exit code, worst first: bad input (2), error (3), fail (1), inconclusive
    (4), then a negative suite's failed-as-expected or pass (0). Checks not evaluated do not count."""
    counted = [c for c in checks if not is_not_evaluated(c)]
    statuses = {c.status for c in counted}
    if any(c.kind == BAD_INPUT for c in counted):
        return BAD_INPUT, EXIT_USAGE
    if "error" in statuses:
        return "error", EXIT_INFRA
    if "fail" in statuses:
        return "fail", EXIT_FAIL
    if "inconclusive" in statuses:
        return "inconclusive", EXIT_INCONCLUSIVE
    if "xfail" in statuses:
        return FAILED_AS_EXPECTED, EXIT_PASS
    return "pass", EXIT_PASS


def conclude(
    checks: list[CheckResult], cancelled: Cancelled | None, elapsed_s: float
) -> tuple[list[CheckResult], str, int]:
    """The run's checks, each failure labelled (:func:`labelled`), verdict and exit code:
    :func:`verdict_of`, unless a signal cancelled it."""
    checks = labelled(checks)
    if cancelled is None:
        return checks, *verdict_of(checks)
    return [*checks, cancelled_check(cancelled, elapsed_s)], "cancelled", cancelled.exit_code


def labelled(checks: list[CheckResult]) -> list[CheckResult]:
    """Each failed check labelled drift where its family judged it so, else regression; any other
    check (an expected failure of a negative suite included) unlabelled."""
    return [dataclasses.replace(c, label=(c.label or REGRESSION) if c.status == "fail" else None) for c in checks]


def run_label(checks: list[CheckResult], verdict: str) -> str | None:
    """The label of a failed run (verdict fail): regression when any failure is one; else change when a
    change check (head against base) failed; else base when a check fails at a change's base too (the
    change is not blamed); else drift. None for any other verdict: an error or a cancellation is not
    judged."""
    if verdict != "fail":
        return None
    labels = {c.label for c in checks if c.status == "fail"}
    return next(label for label in (REGRESSION, CHANGE, BASE_FAILS, DRIFT) if label in labels)


def label_line(checks: list[CheckResult], label: str | None, rebless: str) -> str | None:
    """A failed run's last console line (None unless ``label`` is set): drift names what changed and
    ``rebless``, the command that re-records the golden; a regression names the failed checks."""
    if label is None:
        return None
    if label == DRIFT:
        return drift_line(checks, rebless)
    failed = [c.name for c in checks if c.label == label]
    names = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    drifted = sum(c.label == DRIFT for c in checks)
    also = f" ({drifted} more failed as drift: see their rows)" if drifted else ""
    plural = "s" if len(failed) != 1 else ""
    if label == BASE_FAILS:
        return f"base: {len(failed)} failed check{plural} fail at the base too, not blamed on the change: {names}{also}"
    return f"{label}: {len(failed)} failed check{plural}: {names}{also}"


def cancelled_check(cancelled: Cancelled, elapsed_s: float) -> CheckResult:
    """The check that ends a cancelled run: what stopped it, when, and that its records are kept."""
    detail = (
        f"{cancelled}: the run stopped after {elapsed_s:.1f} s; every step recorded until then is"
        " kept under arms/ (summary.arms says how many)"
    )
    return CheckResult("cancelled", "cancelled", "error", detail)


def unrun_arms(
    suite: SuiteSpec, groups: list[LaunchGroup], launches: list[LaunchResult], records: dict[str, ArmRecords]
) -> dict[str, str]:
    """Arm -> why it never ran: it recorded no step (a resumed arm's second launch: it never loaded
    its checkpoint), and its launch group failed or never started because an earlier one failed.
    Empty when every launch succeeded."""
    if all(r.ok for r in launches):
        return {}

    def cause(r: LaunchResult) -> str:
        root = f" (root cause: rank {r.root.rank})" if r.root and not r.timed_out else ""
        return f"launch {r.group.name} failed{root}"

    results = {r.group.name: r for r in launches}
    why = {}
    for group in groups:
        result = results.get(group.name)
        if result is not None and result.ok:
            continue
        # A group never started when the last launch failed: launching stops at a failure.
        because = cause(result) if result else f"launch {group.name} never started: {cause(launches[-1])}"
        for arm in group.arms:
            if arm in records and not _trained(records[arm], group):
                why[arm] = because
    return why


def _trained(records: ArmRecords, group: LaunchGroup) -> bool:
    """Whether the arm trained in ``group``: a step recorded, or in a resumed arm's second launch,
    whose first launch recorded steps already, its checkpoint loaded (arm.json's ``resumed_from``)."""
    if group.checkpoint == "load":
        return records.facts is not None and records.facts.resumed_from is not None
    return bool(records.steps_done())


def mark_not_evaluated(checks: list[CheckResult], unrun: dict[str, str]) -> list[CheckResult]:
    """Each check that judged an arm of ``unrun`` becomes an error "not evaluated: <why>"."""
    marked = []
    for check in checks:
        arms = [arm for arm in check.arms if arm in unrun]
        if not arms:
            marked.append(check)
            continue
        detail = f"not evaluated: arm '{arms[0]}' never ran: {unrun[arms[0]]}"
        marked.append(
            CheckResult(check.name, check.kind, "error", detail, extra={NOT_EVALUATED: arms[0]}, arms=check.arms)
        )
    return marked


def apply_expectations(suite: SuiteSpec, checks: list[CheckResult]) -> list[CheckResult]:
    """A negative suite's checks: each expected failure that failed becomes ``xfail``, one that passed
    fails, and one that no check produced fails as a check of kind ``expect``."""
    if suite.expect != "fail":
        return checks
    expected = set(suite.expected_failures)
    judged = []
    for check in checks:
        if check.name in expected and check.status == "fail":
            check = dataclasses.replace(check, status="xfail", detail=f"failed as expected: {check.detail}")
        elif check.name in expected and check.status == "pass":
            check = dataclasses.replace(check, status="fail", detail=f"expected to fail, but passed: {check.detail}")
        judged.append(check)
    seen = {c.name for c in checks}
    failing = ", ".join(f"'{c.name}'" for c in judged if c.status == "fail") or "none"
    for name in suite.expected_failures:
        if name not in seen:
            detail = f"expected '{name}' to fail, but no check of that name ran (other failures: {failing})"
            judged.append(CheckResult(f"expect: {name}", "expect", "fail", detail))
    return judged
