"""``harness ci``: a CI gate of several suites, each run as ``harness run`` runs it, one after another.

The gate directory (``--out DIR``, new or empty; default reports/ci/<UTC timestamp>):

    ci.json                 the gate's exit code and verdict, and every attempt of every suite:
                            its exit code, verdict and run directory (relative to the gate's)
    index.html              each suite's verdict and attempts, linking every attempt's report.html
    junit.xml               every suite's final attempt's <testsuite>, merged as the runs wrote them
    <suite>/attempt-<k>/    attempt k's run directory, exactly as ``harness run --out`` leaves it
    logs/harness.log        the gate's log: each attempt's outcome, and every run's own log lines

The three gate files are rewritten after every attempt, so a gate that is killed leaves the
record of what ran.

**Retries.** Only exit 3 (infrastructure: a killed or hung rank, a network error, a launch failure)
is a flake worth another attempt, at most ``--retries`` times; a regression (1), bad usage (2) and
an inconclusive throughput gate (4) would come out the same again, so they are never retried.

**Cancellation.** SIGINT or SIGTERM stops the whole gate: the suite running ends cancelled as in
``harness run``, no later suite starts, the gate files are written, and the exit code is 128 + N.
A second signal exits at once.

**The worst code**, the gate's exit code, ranks the codes by what CI must do about them, a code
whose remedy is not a rerun first: a signal (128 + N: the gate did not finish, and retrying a
cancellation is wrong) > 1 (a regression: block the change; no rerun of the gate can turn it
green) > 2 (usage: fix the gate's command or goldens; a rerun fails the same) > 3 (infrastructure
that outlived the retries: rerun later, or look at the crash) > 4 (inconclusive: measure again with
more blocks) > 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

from harness.cancel import Cancellation, Cancelled
from harness.files import write_json_atomic
from harness.golden import GoldenError
from harness.prepare import RunOptions, UsageError, check_device
from harness.report.checks import verdict_label
from harness.report.html import write_ci_index
from harness.report.junit import junit_testsuite, read_testsuites, write_merged_junit
from harness.revisions import Revision
from harness.run import run_suite
from harness.rundir import HARNESS_LOG, JUNIT, REPORT, REPORTS_DIR, SUMMARY, fresh_dir, harness_log
from harness.specs import SuiteSpec
from harness.verdict import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_PASS, EXIT_USAGE

log = logging.getLogger("harness.ci")  # into the gate's logs/harness.log, beside every run's own lines

# Best to worst below the signals (see the module docstring); every 128 + N ranks above them all.
EXIT_ORDER = (EXIT_PASS, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_USAGE, EXIT_FAIL)
WORST_ORDER = "signal (128+N) > 1 regression > 2 usage > 3 infrastructure > 4 inconclusive > 0 pass"
VERDICTS = {
    EXIT_PASS: "pass",
    EXIT_FAIL: "fail",
    EXIT_USAGE: "usage",
    EXIT_INFRA: "error",
    EXIT_INCONCLUSIVE: "inconclusive",
}
NOT_RUN = "not run"


def severity(code: int) -> int:
    """Position of an exit code in the worst-code order: higher is worse; any signal beats every verdict."""
    return len(EXIT_ORDER) + code if code >= 128 else EXIT_ORDER.index(code)


def worst_exit_code(codes: Iterable[int]) -> int:
    """The gate's exit code: the worst of its suites' final codes (0 for none)."""
    return max(codes, key=severity, default=EXIT_PASS)


def verdict_of_code(code: int) -> str:
    return "cancelled" if code >= 128 else VERDICTS[code]


@dataclass
class Attempt:
    """One run of one suite: its exit code, verdict (summary.json's, or why there is none) and run dir."""

    attempt: int  # 1, 2, ...
    exit_code: int
    verdict: str
    run_dir: str | None  # relative to the gate directory; None when the run was refused before it existed
    duration_s: float
    error: str | None = None
    report: str | None = None  # the run's report.html, relative to the gate directory, when it was written
    label: str | None = None  # a failed run's summary.json label: "drift" or "regression"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "duration_s": round(self.duration_s, 3)}


@dataclass
class SuiteOutcome:
    """A suite of the gate and its attempts, in order; the last one is its verdict."""

    suite: str
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def final(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def to_dict(self) -> dict:
        final = self.final
        return {
            "suite": self.suite,
            "verdict": final.verdict if final else NOT_RUN,
            "exit_code": final.exit_code if final else None,
            "label": final.label if final else None,
            "report": final.report if final else None,
            "attempts": [a.to_dict() for a in self.attempts],
        }


def make_gate_dir(out: Path | None) -> Path:
    """``--out DIR`` (new or empty), else reports/ci/<UTC timestamp>."""
    return fresh_dir(
        out or REPORTS_DIR / "ci" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"), "gate directory"
    )


def check_gate(suites: list[SuiteSpec], options: RunOptions, retries: int) -> None:
    """Everything a gate can refuse before it runs anything (exit 2)."""
    if retries < 0:
        raise UsageError(f"--retries: expected an int >= 0, got {retries}")
    names = [suite.name for suite in suites]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise UsageError(f"harness ci: suite {', '.join(twice)} named more than once (each gets OUT/<suite>/)")
    for suite in suites:
        check_device(suite, options.device)


def run_gate(
    suites: list[SuiteSpec],
    options: RunOptions,
    retries: int,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    revisions: Mapping[str, dict[str, Revision]] | None = None,
) -> int:
    """Runs the suites one after another into ``options.out`` (the gate directory), retrying exit 3
    at most ``retries`` times per suite, and returns the worst exit code. Raises UsageError before
    running anything when the gate cannot run. ``revisions``: a change gate's (``--base``), by suite
    name: each suite's arms at both (harness/change.py)."""
    check_gate(suites, options, retries)
    gate_dir = make_gate_dir(options.out)
    outcomes = [SuiteOutcome(suite.name) for suite in suites]
    gate = {"command": list(options.command), "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    gate |= {"device": options.device, "retries": retries, "worst_order": WORST_ORDER}
    with harness_log(gate_dir), Cancellation() as cancellation:
        try:
            for suite, outcome in zip(suites, outcomes):
                for number in range(1, retries + 2):
                    print(f"ci: {suite.name}: attempt {number} of at most {retries + 1}", file=out, flush=True)
                    changed = dataclasses.replace(options, revisions=(revisions or {}).get(suite.name, {}))
                    attempt = run_attempt(suite, changed, gate_dir, number, out, err)
                    outcome.attempts.append(attempt)
                    log.info("%s attempt %d: exit %d (%s)", suite.name, number, attempt.exit_code, attempt.verdict)
                    write_gate(gate_dir, gate, outcomes)
                    if attempt.exit_code >= 128:
                        cancellation.signum = attempt.exit_code - 128  # a second signal now aborts at once
                        raise Cancelled(attempt.exit_code - 128)
                    if attempt.exit_code != EXIT_INFRA:
                        break
                    if number <= retries:
                        print(f"ci: {suite.name}: exit 3 (infrastructure), retrying", file=out, flush=True)
        except Cancelled as c:
            print(f"ci: {c}: the gate stops; later suites are not run", file=err, flush=True)
            log.info("gate %s", c)
            cancellation.signum = c.signum
            gate["cancelled"] = str(c)
            gate_code = c.exit_code
        else:
            gate_code = worst_exit_code(o.final.exit_code for o in outcomes)
        write_gate(gate_dir, gate, outcomes, gate_code)
    print(format_gate(gate_dir, outcomes, gate_code), file=out)
    return gate_code


def run_attempt(
    suite: SuiteSpec, options: RunOptions, gate_dir: Path, number: int, out: TextIO, err: TextIO
) -> Attempt:
    """One ``harness run`` of the suite into <gate>/<suite>/attempt-<number>/, as an Attempt.

    A run refused before it starts (a golden that ``--golden check`` cannot find) is exit 2, and an
    error escaping the run is exit 3 with its traceback in the gate's logs/harness.log; a cancellation is the run's own.
    """
    relative = Path(suite.name) / f"attempt-{number}"
    run_dir = gate_dir / relative
    start = time.monotonic()
    try:
        code = run_suite(suite, dataclasses.replace(options, out=run_dir), out, err)
    except (UsageError, GoldenError) as e:
        print(f"error: {e}", file=err)
        return Attempt(number, EXIT_USAGE, "usage", None, time.monotonic() - start, error=str(e))
    except Exception as e:
        log.exception("%s attempt %d: internal error", suite.name, number)
        message = f"internal error: {type(e).__name__}: {e} (traceback: {gate_dir / HARNESS_LOG})"
        print(f"error: {message}", file=err)
        shown = str(relative) if run_dir.is_dir() else None
        return Attempt(number, EXIT_INFRA, "error", shown, time.monotonic() - start, error=message)
    summary = _summary(run_dir)
    verdict = summary.get("verdict", verdict_of_code(code))
    report = str(relative / REPORT) if (run_dir / REPORT).is_file() else None
    elapsed = time.monotonic() - start
    return Attempt(number, code, verdict, str(relative), elapsed, summary.get("error"), report, summary.get("label"))


def _summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}


def write_gate(gate_dir: Path, gate: dict, outcomes: list[SuiteOutcome], exit_code: int | None = None) -> None:
    """ci.json, junit.xml, then index.html; ``exit_code`` None while the gate is still running."""
    record = {
        **gate,
        "verdict": "running" if exit_code is None else verdict_of_code(exit_code),
        "exit_code": exit_code,
        "suites": [o.to_dict() for o in outcomes],
    }
    write_json_atomic(gate_dir / "ci.json", record)
    write_merged_junit(gate_dir / JUNIT, [t for o in outcomes for t in _testsuites(gate_dir, o, gate)])
    write_ci_index(gate_dir / "index.html", record)


def _testsuites(gate_dir: Path, outcome: SuiteOutcome, gate: dict) -> list[ET.Element]:
    """The final attempt's <testsuite> as its run wrote it; one made up where there is none to read
    (a run refused before it started, unreadable outputs, a suite the gate never reached), so that
    no suite of the gate is missing from CI's view."""
    final = outcome.final
    if final is None:
        why = f" ({gate['cancelled']})" if "cancelled" in gate else ""
        reason = f"not run: the gate stopped{why} before this suite"
        return [junit_testsuite({"suite": outcome.suite, "checks": [_run_case("skip", reason)]})]
    if final.run_dir is not None:
        path = gate_dir / final.run_dir / JUNIT
        try:
            return read_testsuites(path)
        except (OSError, ET.ParseError) as e:
            reason = f"attempt {final.attempt} left no readable {path}: {e}"
            return [junit_testsuite({"suite": outcome.suite, "checks": [_run_case("error", reason)]})]
    reason = final.error or f"attempt {final.attempt} ended with exit code {final.exit_code}"
    return [junit_testsuite({"suite": outcome.suite, "checks": [_run_case("error", reason)]})]


def _run_case(status: str, detail: str) -> dict:
    return {"name": "run", "kind": "run", "status": status, "detail": detail}


def format_gate(gate_dir: Path, outcomes: list[SuiteOutcome], exit_code: int) -> str:
    """The console's last lines: the gate's verdict, one line per suite, and where the files are."""
    lines = [f"ci: {verdict_of_code(exit_code).upper()} (exit {exit_code}) - {len(outcomes)} suites"]
    width = max(len(o.suite) for o in outcomes)
    shown = {o.suite: verdict_label(o.final.verdict, o.final.label) if o.final else NOT_RUN.upper() for o in outcomes}
    column = max(12, *map(len, shown.values()))
    for outcome in outcomes:
        final = outcome.final
        if final is None:
            lines.append(f"  {shown[outcome.suite]:<{column}}  {outcome.suite:<{width}}")
            continue
        tries = f"{len(outcome.attempts)} attempt{'s' if len(outcome.attempts) > 1 else ''}"
        where = final.report or final.run_dir or final.error
        lines.append(
            f"  {shown[outcome.suite]:<{column}}  {outcome.suite:<{width}}  exit {final.exit_code}, {tries}: {where}"
        )
    lines += [f"index: {gate_dir / 'index.html'}", f"junit: {gate_dir / 'junit.xml'}"]
    return "\n".join(lines)
