"""Reviewable output of a run: HTML for people, JUnit XML for CI, a plain-text table for the terminal."""

from __future__ import annotations

from harness.report.checks import not_evaluated, problems_first, status_counts, status_label, tally, verdict_label
from harness.report.html import write_html
from harness.report.junit import write_junit
from harness.report.throughput import improvement_note, read_throughput
from harness.results import NOT_EVALUATED

__all__ = ["format_verdict_table", "read_throughput", "write_html", "write_junit"]


def format_verdict_table(summary: dict) -> str:
    """A short aligned table of the checks under a one-line verdict, problems first.

    A throughput run whose B is much faster than its A says so under the verdict: that usually
    means the baseline moved, and a green line alone would hide it. Checks not evaluated (their arm
    never ran) are one row, naming the arms: the launch's own row above says why. A failed run's
    verdict carries its label ("FAIL [drift: re-bless]"), and a check that failed by drift reads DRIFT.
    """
    checks = problems_first(summary.get("checks", []))
    verdict, counts = verdict_label(summary.get("verdict"), summary.get("label")), tally(status_counts(checks))
    shown = [c for c in checks if not not_evaluated(c)]
    unrun = [c for c in checks if not_evaluated(c)]
    rows = [(status_label(c).upper(), str(c.get("name", "?")), str(c.get("detail", ""))) for c in shown]
    throughput = summary.get("throughput") or {}
    steps = f"{summary.get('steps')} steps"
    if throughput:
        steps = f"{throughput.get('blocks')} ABBA blocks of {steps}"
    head = (
        f"{summary.get('suite')}: {verdict} (exit {summary.get('exit_code')})"
        f" - {len(checks)} checks, {summary.get('ranks')} ranks, {steps},"
        f" {float(summary.get('duration_s') or 0.0):.1f} s"
    )
    if note := improvement_note(throughput):
        head += f"\n  note: {note}"
    if unrun:
        arms = ", ".join(f"'{arm}'" for arm in dict.fromkeys(c["extra"][NOT_EVALUATED] for c in unrun))
        at = len([c for c in shown if c.get("status") in ("error", "fail")])  # after the problems
        rows.insert(at, ("ERROR", f"{len(unrun)} checks not evaluated", f"arms {arms}: never ran"))
    if not rows:
        return f"{head}\n  (no checks ran)"
    width_status = max(len(r[0]) for r in rows)
    width_name = max(len(r[1]) for r in rows)
    lines = [f"  {s:<{width_status}}  {n:<{width_name}}  {d}" for s, n, d in rows]
    return "\n".join([head, *lines, counts])
