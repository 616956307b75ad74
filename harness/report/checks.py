"""How every report orders, counts and groups the checks of summary.json.

The console table, report.html and junit.xml must agree on what counts as a problem and in which
order a reviewer meets it, so the order and the tally live here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.results import DRIFT, FAILED_AS_EXPECTED, NOT_EVALUATED, STATUSES

PROBLEMS = frozenset({"error", "fail", "inconclusive"})


def not_evaluated(check: dict) -> bool:
    """Whether a check of summary.json judged an arm that never ran (verdict.py)."""
    return bool((check.get("extra") or {}).get(NOT_EVALUATED))


def status_counts(checks: list[dict]) -> dict[str, int]:
    """How many checks (summary.json's form) have each status, every status present (0 when none),
    and how many of the errors are checks not evaluated (``not_evaluated``)."""
    counts = {status: sum(c.get("status") == status for c in checks) for status in STATUSES}
    return {**counts, NOT_EVALUATED: sum(map(not_evaluated, checks))}


def _rank(check: dict) -> int:
    """Errors, failures and inconclusive gates before everything else (passes and skips keep run
    order); checks not evaluated, errors that follow from another, after those."""
    status = check.get("status")
    if not_evaluated(check):
        return len(PROBLEMS)
    return STATUSES.index(status) if status in PROBLEMS else len(PROBLEMS) + 1


def problems_first(checks: list[dict]) -> list[dict]:
    """Errors, then failures, then inconclusive gates, then checks not evaluated, then the rest, each
    in run order: what a reviewer needs comes first."""
    return sorted(checks, key=_rank)


def tally(counts: dict[str, int]) -> str:
    """One line of counts; inconclusive gates, expected failures and checks not evaluated are named
    only when there are some, as most runs have none."""
    inconclusive = f", {counts['inconclusive']} inconclusive" if counts.get("inconclusive") else ""
    expected = f", {counts['xfail']} failed as expected" if counts.get("xfail") else ""
    unrun = f" ({counts[NOT_EVALUATED]} not evaluated)" if counts.get(NOT_EVALUATED) else ""
    return (
        f"{counts['pass']} passed, {counts['fail']} failed{expected}{inconclusive}, {counts['error']} errors{unrun},"
        f" {counts['skip']} skipped"
    )


def verdict_label(verdict: object, label: object = None) -> str:
    """A verdict as the console and the report headline show it: "FAILED AS EXPECTED", "PASS"; a
    failed run with its label: "FAIL [drift: re-bless]", "FAIL [regression]"."""
    shown = "failed as expected".upper() if verdict == FAILED_AS_EXPECTED else str(verdict).upper()
    if not label:
        return shown
    return f"{shown} [{'drift: re-bless' if label == DRIFT else label}]"


def status_label(check: dict) -> str:
    """A check's status as the console's rows show it: "drift" for a failure labelled so, apart
    from the failures that are regressions."""
    return DRIFT if check.get("label") == DRIFT else str(check.get("status", "?"))


@dataclass(frozen=True)
class CheckGroup:
    """The checks of one kind, problems first, with the arms they concern and their counts."""

    kind: str
    checks: list[dict]
    arms: list[str]
    counts: dict[str, int]

    @property
    def has_problems(self) -> bool:
        """Whether the group holds an error, a failure or an inconclusive gate: then it opens by itself."""
        return any(self.counts[s] for s in PROBLEMS)

    @property
    def summary(self) -> str:
        """e.g. "3 checks: 2 pass, 1 fail" - only the statuses present, worst first."""
        parts = ", ".join(f"{self.counts[s]} {s}" for s in STATUSES if self.counts[s])
        return f"{len(self.checks)} check{'s' if len(self.checks) != 1 else ''}: {parts}"


def group_by_kind(checks: list[dict]) -> list[CheckGroup]:
    """One group per check kind: groups holding the worst statuses first, otherwise in run order."""
    by_kind: dict[str, list[dict]] = {}
    for check in checks:
        by_kind.setdefault(str(check.get("kind", "?")), []).append(check)
    groups = []
    for kind, members in by_kind.items():
        arms = list(dict.fromkeys(arm for c in members for arm in c.get("arms") or []))
        groups.append(CheckGroup(kind, problems_first(members), arms, status_counts(members)))
    return sorted(groups, key=lambda g: _rank(g.checks[0]))
