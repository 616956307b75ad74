"""Writing a judged run, the only place that writes its results: the golden of ``--golden update``,
``summary.json``, ``junit.xml``, then ``report.html``, and the console's verdict
(:func:`write_outputs`); and ``harness report``, which renders them again (:func:`rerender`).

``summary.json`` is one typed value, :class:`Summary`, with a schema version and a JSON Schema
(``docs/schema/summary.schema.json``) for readers without the harness.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pandas as pd

from harness.cancel import Cancelled
from harness.files import write_json_atomic
from harness.golden import Golden, GoldenError, load_golden
from harness.golden_plan import update_golden
from harness.judge import Judgement
from harness.launchers import LaunchResult
from harness.launching import Launched
from harness.manifest import Manifest, ManifestError
from harness.phases import PhaseLog, read_rank_phases, timeline
from harness.prepare import PreparedRun, UsageError
from harness.records import RecordError, RunRecords, read_metrics
from harness.report import format_verdict_table, read_throughput, write_html, write_junit
from harness.report.checks import status_counts
from harness.results import CheckResult
from harness.rundir import JUNIT, REPORT, SUMMARY, arm_files
from harness.verdict import EXIT_FAIL, EXIT_INFRA, EXIT_PASS, cancelled_check, conclude

SCHEMA_VERSION = 1
log = logging.getLogger("harness")


@dataclass(frozen=True)
class Summary:
    """summary.json: the verdict, the exit code, every check, and what the run was and took."""

    suite: str
    subject: str
    verdict: str
    exit_code: int
    ranks: int
    steps: int  # per arm; per block position in a throughput run
    arms: dict[str, dict[str, int]]
    duration_s: float
    env_key: str
    golden: dict[str, Any]
    launches: list[dict[str, Any]]
    error: str | None
    counts: dict[str, int]
    checks: list[dict[str, Any]]
    throughput: dict[str, Any] | None
    timing: dict[str, Any] | None = None
    label: str | None = None  # a failed run's: drift (re-record the golden) or regression (verdict.py)
    label_line: str | None = None  # the console's last line: the label, and what changed or what failed
    change: dict[str, Any] | None = None  # a change check's (--base): its line, and its revisions by label
    schema_version: int = SCHEMA_VERSION

    def with_check(self, check: CheckResult, verdict: str, exit_code: int) -> Summary:
        """The summary with one more check (a cancellation, an output error) deciding the run: a
        verdict other than fail, so without a label."""
        checks = [*self.checks, check.to_dict()]
        counts = status_counts(checks)
        return dataclasses.replace(
            self, verdict=verdict, exit_code=exit_code, checks=checks, counts=counts, label=None, label_line=None
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def write_outputs(
    run: PreparedRun,
    launched: Launched,
    records: RunRecords,
    judgement: Judgement,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Writes the run's files and prints its verdict table, the golden's news, the run directory and,
    last, a failed run's label line; returns the exit code (exit 3 where the outputs themselves
    could not be written)."""
    judgement = write_golden_update(run, launched, records, judgement)
    summary = build_summary(run, launched, records, judgement)
    metrics = {arm: rec.metrics for arm, rec in records.items() if rec.steps_done()}
    golden = run.golden.golden if run.golden.mode == "check" else None
    summary = finish(run.run_dir, summary, run.manifest, metrics, golden, err, run.phases)
    if summary.change:
        print(summary.change["line"], file=out)
    print(format_verdict_table(summary.to_json()), file=out)
    if judgement.golden_news:
        print(judgement.golden_news, file=out)
    print(f"run dir: {run.run_dir}", file=out)
    if summary.label_line:
        print(summary.label_line, file=out)
    return summary.exit_code


def write_golden_update(run: PreparedRun, launched: Launched, records: RunRecords, judged: Judgement) -> Judgement:
    """``--golden update``: the run's trajectories written as its environment's golden once the run
    passed; the judgement with what became of the golden. A signal while writing cancels the run,
    and the old golden stays (it is replaced atomically)."""
    golden = run.golden
    if golden.mode != "update":
        return judged
    news = f"not updating {golden.shown(golden.path)}: the run did not pass"
    if judged.exit_code == EXIT_PASS:
        metrics = {arm: rec.metrics for arm, rec in records.items() if rec.steps_done()}
        try:
            news = update_golden(golden, run.suite, run.manifest, metrics)
        except Cancelled as c:
            checks, verdict, exit_code = conclude(judged.checks, c, launched.elapsed_s())
            judged = dataclasses.replace(
                judged, checks=checks, verdict=verdict, exit_code=exit_code, label=None, label_line=None
            )
            news = f"not updating {golden.shown(golden.path)}: {c}"
    return dataclasses.replace(judged, golden_outcome=news.splitlines()[-1], golden_news=news)


def build_summary(run: PreparedRun, launched: Launched, records: RunRecords, judged: Judgement) -> Summary:
    """The summary of a judged run (docs/architecture.md, "The summary"), its timing still to come."""
    suite, checks = run.suite, [c.to_dict() for c in judged.checks]
    return Summary(
        suite=suite.name,
        subject=suite.subject,
        verdict=judged.verdict,
        exit_code=judged.exit_code,
        ranks=suite.ranks,
        steps=run.kind.steps,
        arms=run.kind.reported_arms(records),
        duration_s=round(launched.elapsed_s(), 3),
        env_key=run.key,
        golden=run.golden.summary(judged.golden_outcome),
        launches=[_launch_summary(r) for r in launched.results],
        error="\n".join(r.error for r in launched.results if r.error) or None,
        counts=status_counts(checks),
        checks=checks,
        throughput=next((c.extra["throughput"] for c in judged.checks if c.kind == "throughput"), None),
        label=judged.label,
        label_line=judged.label_line,
        change=_change(run, judged),
    )


def _change(run: PreparedRun, judged: Judgement) -> dict[str, Any] | None:
    """summary.json's ``change``: the line the console and the report open with, and both revisions."""
    revisions = run.manifest.revisions
    if not revisions:
        return None
    base = run.base.line if run.base else None
    revisions = {label: r.to_dict() for label, r in revisions.items()}
    # The first op where the two revisions part, where the op-level re-run located it (first_op.py).
    located = [c.extra["first_op_divergence"]["line"] for c in judged.checks if "first_op_divergence" in c.extra]
    line = "; ".join([judged.change_line or "not judged", *located[:1]])
    return {"line": line, "revisions": revisions, "base_records": base}


def _launch_summary(result: LaunchResult) -> dict:
    return {
        "group": result.group.name,
        "ranks": result.group.ranks,
        "duration_s": round(result.duration_s, 3),
        "timed_out": result.timed_out,
        "error": result.error,
        "root_cause": _root_cause(result),
        **({"slurm_job": result.job} if result.job else {}),
    }


def _root_cause(result: LaunchResult) -> dict | None:
    """How a failed launch is judged, and the rank that died first (none for a timeout: all hung)."""
    if result.verdict is None:
        return None
    rank = result.root.rank if result.root and not result.timed_out else None
    return {**dataclasses.asdict(result.verdict), "rank": rank}


def finish(
    run_dir: Path,
    summary: Summary,
    manifest: Manifest,
    metrics: dict[str, pd.DataFrame],
    golden: Golden | None,
    err: TextIO,
    phases: PhaseLog,
) -> Summary:
    """Writes summary.json, junit.xml, then report.html; returns the summary as written.

    The cheap, essential files go first, so that a second signal during the slow report leaves
    them behind. A signal arriving now turns the verdict into ``cancelled`` and writes them again;
    a report that cannot be rendered is an infrastructure error (exit 3), logged with its traceback.
    Once the report is written, summary.json is written again with the report's own time.
    """
    for attempt in range(2):
        try:
            summary = dataclasses.replace(summary, timing=run_timing(run_dir, phases))
            write_json_atomic(run_dir / SUMMARY, summary.to_json())
            with phases.phase("report"):
                write_reports(run_dir, summary.to_json(), metrics, golden, manifest.to_json(), read_throughput(run_dir))
            summary = dataclasses.replace(summary, timing=run_timing(run_dir, phases))
            write_json_atomic(run_dir / SUMMARY, summary.to_json())
            return summary
        except Cancelled as c:
            check = cancelled_check(c, summary.duration_s)
            summary = summary.with_check(check, "cancelled", c.exit_code)
        except Exception as e:
            log.exception("writing the run's outputs failed")
            print(
                f"error: writing the outputs failed: {type(e).__name__}: {e} (see {run_dir}/logs/harness.log)", file=err
            )
            if summary.exit_code in (EXIT_PASS, EXIT_FAIL) and attempt == 0:
                check = CheckResult(
                    "outputs", "outputs", "error", f"writing the outputs failed: {type(e).__name__}: {e}"
                )
                summary = summary.with_check(check, "error", EXIT_INFRA)
                continue
            return dataclasses.replace(summary, exit_code=EXIT_INFRA)
    return summary


def run_timing(run_dir: Path, phases: PhaseLog) -> dict:
    """summary.json's ``timing``: the harness's phases and the run's timeline (phases.py), with the ranks'
    phases read from the run directory."""
    groups = {p["group"] for p in phases.phases if p["phase"] == "launch"}
    segments = timeline(phases.phases, {group: read_rank_phases(run_dir, group) for group in groups})
    return {
        "phases": phases.phases,
        "timeline": segments,
        "total_s": sum(s["seconds"] for s in segments),
    }


def write_reports(
    run_dir: Path,
    summary: dict,
    metrics: dict[str, pd.DataFrame],
    golden: Golden | None,
    manifest: dict,
    throughput: pd.DataFrame | None,
) -> None:
    """junit.xml, then report.html (the slow one), from a run's summary and records; each written
    atomically, its name in the error when the write fails (files.py)."""
    write_junit(run_dir / JUNIT, summary)
    html_golden = golden_frames(golden)
    write_html(run_dir / REPORT, summary, metrics, golden=html_golden, manifest=manifest, throughput=throughput)


def golden_frames(golden: Golden | None) -> dict[str, pd.DataFrame] | None:
    """A golden as the report wants it: arm -> step-indexed DataFrame."""
    if golden is None:
        return None
    return {arm: pd.DataFrame(metrics) for arm, metrics in golden.arms.items()}


def rerender(run_dir: Path, out: TextIO = sys.stdout) -> int:
    """``harness report RUN_DIR``: rebuild report.html and junit.xml from what the run left."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
        manifest = Manifest.read(run_dir)
        metrics = {
            arm: read_metrics(arm_files(run_dir, arm).metrics)
            for arm in manifest.suite["arms"]
            if arm_files(run_dir, arm).metrics.is_file()
        }
        compared = manifest.golden.get("compared")
        golden = load_golden(Path(compared)) if compared and os.path.isfile(compared) else None
        throughput = read_throughput(run_dir)
    except (OSError, ValueError, KeyError, TypeError, RecordError, GoldenError, ManifestError) as e:
        raise UsageError(f"{run_dir}: not a readable run directory: {e}") from None
    write_reports(run_dir, summary, metrics, golden, manifest.to_json(), throughput)
    print(format_verdict_table(summary), file=out)
    print(f"run dir: {run_dir}", file=out)
    if summary.get("label_line"):
        print(summary["label_line"], file=out)
    return EXIT_PASS
