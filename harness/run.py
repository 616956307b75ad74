"""One ``harness run``: suite -> launches -> records -> checks -> golden -> summary, report, junit -> exit code.

Exit codes are the CI contract: 0 every check passed; 1 a check failed (a regression, a rank
raising from the system under test included, see triage.py); 2 bad usage, suite or input
(nothing was launched); 3 infrastructure (a rank killed or hung, a timeout, a launch failure, an
error in the harness itself: a flake, or a crash to look at); 4 inconclusive (a throughput gate
whose interval straddles its threshold: rerun with more blocks); 128 + N cancelled by signal N.
A throughput run (harness/throughput.py) has one check, its gate, and no golden.
Whatever happens after the run directory exists, summary.json, junit.xml and report.html are
written (in that order), partial records stay on disk, and the harness's own log, with any
traceback, is logs/harness.log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import pandas as pd
import torch

import harness
from harness.cancel import Cancellation, Cancelled
from harness.checks import run_check
from harness.compare import CheckResult
from harness.environment import CpuPin, backend_for, cpu_pin, device_class, run_env_key, versions
from harness.golden import (
    Golden,
    GoldenError,
    GoldenPlan,
    diff_summary,
    golden_checks,
    golden_from_metrics,
    load_golden,
    plan_golden,
    write_golden,
)
from harness.launchers import GroupLauncher, LaunchContext, LaunchGroup, LaunchResult, plan_launches
from harness.launchers.local import launch_group
from harness.phases import PhaseLog, cache_notes, read_rank_phases, timeline
from harness.progress import BlockProgress, Progress
from harness.records import (
    ArmRecords,
    QuietFileHandler,
    RecordError,
    naming_file,
    read_arm,
    read_metrics,
    write_json_atomic,
)
from harness.report import format_verdict_table, read_throughput, write_html, write_junit
from harness.report.figures import import_in_background
from harness.rundir import HARNESS_LOG, JUNIT, LOGS_DIR, MANIFEST, REPORT, SUMMARY, arm_files
from harness.shipped import shipped_dir
from harness.specs import SuiteSpec
from harness.subject import Subject, load_subject
from harness.throughput import judge_throughput, plan_throughput_launches
from harness.triage import REGRESSION
from harness.verdict import (
    EXIT_FAIL,
    EXIT_INFRA,
    EXIT_PASS,
    apply_expectations,
    mark_not_evaluated,
    status_counts,
    unrun_arms,
    verdict_of,
)

# Run directories go under ./reports of the working directory: never into an installed package.
REPORTS_DIR = Path("reports")
TRACE_ENV = "HARNESS_TRACE_CACHE"
# The shipped goldens; HARNESS_GOLDEN_DIR moves the default golden root (a CI cache, a test's empty directory).
GOLDEN_DIR = Path(os.environ.get("HARNESS_GOLDEN_DIR", shipped_dir("golden")))
log = logging.getLogger("harness")


class UsageError(Exception):
    """Bad usage or input detected before launching; one line, exit code 2."""


@dataclass(frozen=True)
class RunOptions:
    """How to run a suite: the command line's options, validated."""

    device: str = "cpu"
    out: Path | None = None
    timeout_s: float = 600.0
    golden: str = "auto"  # auto: check when a golden applies to this environment
    golden_dir: Path = GOLDEN_DIR
    cpu_isa: str = "avx2"  # avx2: the portable kernel pin (environment.py); native: opt out
    command: tuple[str, ...] = ()
    verbose: bool = False  # plain per-step lines on a terminal too, in place of the live display
    trace_cache: Path | None = None  # where traced arms keep their graphs (reference/chunking/trace_cache.py)


def trace_cache_dir(flag: str | None) -> Path | None:
    """``--trace-cache DIR|off``, else $HARNESS_TRACE_CACHE (the same), else the user's cache directory;
    None for off. A path that exists and is not a directory is a usage error naming where it came from."""
    source, value = ("--trace-cache", flag) if flag is not None else ("HARNESS_TRACE_CACHE", os.environ.get(TRACE_ENV))
    if value is None:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harness" / "traces"
    if value == "off":
        return None
    if not value:
        raise UsageError(f"{source}: expected a directory or off, got an empty value")
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{source} {value}: exists and is not a directory")
    return path


def usable_trace_cache(path: Path | None, subject: Subject) -> tuple[Path | None, str | None]:
    """The trace cache the ranks may use (None: off), and the line saying why not when the subject
    finds its folder unsafe (the reference: reference/chunking/trace_cache.py): the run then traces,
    and is judged on its merits."""
    problem = getattr(subject, "cache_problem", None)
    why = problem(path) if path is not None and problem is not None else None
    return (None, why) if why else (path, None)


def suite_subject(suite: SuiteSpec) -> Subject:
    """The suite's system under test (harness/subject/)."""
    return load_subject(suite.subject, suite.path.resolve().parent)


def suite_dtype(suite: SuiteSpec) -> str:
    return "+".join(sorted({arm.dtype for arm in suite.arms.values()}))


def golden_config(suite: SuiteSpec) -> dict:
    """What a golden is recorded for: steps, and each arm's processes and non-default fields.

    Non-default fields only: a field the reference adds later leaves goldens comparable, while a
    changed default moves the numerics and shows up as a golden failure, as it should.
    """
    arms = {a.name: {"ranks": a.ranks, "config": a.golden_config} for a in suite.arms.values()}
    return {"steps": suite.steps, "arms": arms}


def check_device(suite: SuiteSpec, device: str) -> None:
    if device != "cuda":
        return
    needed = max(arm.ranks for arm in suite.arms.values())
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise UsageError(f"--device cuda: suite {suite.name} needs {needed} GPUs (one per rank), {have} visible")


def make_run_dir(suite: SuiteSpec, out: Path | None) -> Path:
    """``--out DIR`` (new or empty), else ./reports/<suite>/<UTC timestamp>[-n], never reused."""
    if out is not None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError(f"--out {out}: exists and is not an empty directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / LOGS_DIR).mkdir()
        except OSError as e:
            raise UsageError(f"--out {out}: cannot create the run directory: {e.strerror}") from None
        return out
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = REPORTS_DIR.absolute() / suite.name
    try:
        base.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            path = base / (stamp if n == 1 else f"{stamp}-{n}")
            try:
                path.mkdir()
            except FileExistsError:
                continue
            (path / LOGS_DIR).mkdir()
            return path
    except OSError as e:
        raise UsageError(f"{base}: cannot create a run directory ({e.strerror}); choose one with --out DIR") from None
    raise UsageError(f"{base}: cannot create a run directory for {stamp}")


@contextmanager
def harness_log(run_dir: Path) -> Iterator[Path]:
    """The harness's own log for one run, logs/harness.log: decisions, and every traceback."""
    path = run_dir / HARNESS_LOG
    handler = QuietFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield path
    finally:
        log.removeHandler(handler)
        handler.close()


# --- the run -------------------------------------------------------------------------------


def build_manifest(
    suite: SuiteSpec, options: RunOptions, key: str, pin: CpuPin | None, golden: GoldenPlan, groups: list[LaunchGroup]
) -> dict:
    return {
        "command": list(options.command),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "suite": suite.to_dict(),
        "versions": versions(),
        "device": options.device,
        "device_class": device_class(options.device, pin),
        "cpu_isa": pin.to_dict() if pin else None,
        "backend": backend_for(options.device),
        "ranks": suite.ranks,
        "seed": sorted({arm.seed for arm in suite.arms.values()}),
        "env_key": key,
        "golden_config": golden_config(suite),
        "launches": [dataclasses.asdict(g) for g in groups],
        "golden": _golden_record(golden),
        "timeout_s": options.timeout_s,
        "trace_cache": str(options.trace_cache) if options.trace_cache else None,
    }


def _golden_record(golden: GoldenPlan) -> dict:
    """manifest.json's ``golden``: the plan with absolute paths, as ``harness collect`` reloads it."""
    return {
        "mode": golden.mode,
        "path": str(golden.path),
        "compared": str(golden.compared) if golden.compared else None,
        "root": str(golden.root) if golden.root else None,
        "tier": golden.tier,
        "note": golden.note,
    }


def _golden_summary(golden: GoldenPlan, checks: list[CheckResult]) -> dict:
    """summary.json's ``golden``: the plan announced before the run and the outcome judged after it,
    with paths relative to the checkout or the golden root."""
    return {
        "mode": golden.mode,
        "path": golden.shown(golden.path),
        "compared": golden.shown(golden.compared) if golden.compared else None,
        "tier": golden.tier,
        "plan": golden.note,
        "outcome": golden.outcome(checks),
    }


def launch_all(
    run_dir: Path,
    suite: SuiteSpec,
    groups: list[LaunchGroup],
    timeout_s: float,
    env: dict[str, str],
    out: TextIO,
    phases: PhaseLog,
    verbose: bool = False,
    launch: GroupLauncher = launch_group,
) -> Iterator[LaunchResult]:
    """Launch groups one after another under one deadline, yielding each result; the first
    failure ends the run. ``launch`` runs one group: locally (launchers/local.py) or as a Slurm job
    (launchers/slurm/watch.py)."""
    deadline = time.monotonic() + timeout_s
    spec = suite.throughput
    if spec:
        roles = {"A": spec.a, "B": spec.b, **({"control": spec.a} if spec.control else {})}
        progress: Progress | BlockProgress = BlockProgress(run_dir, roles, spec.blocks, out, verbose)
    else:
        progress = Progress(run_dir, [arm for group in groups for arm in group.arms], suite.steps, out, verbose)
    context = LaunchContext(run_dir, deadline, timeout_s, env, progress.tick, suite_subject(suite).source)
    try:
        for group in groups:
            with phases.phase("launch", group=group.name):
                result = launch(group, context)
            log.info("group %s: %s", group.name, result.headline or "ok")
            if not result.ok:
                progress.close()  # its last state stays above the error the caller prints
            yield result
            if not result.ok:
                return
    finally:
        progress.close()


def launch_checks(launches: list[LaunchResult]) -> list[CheckResult]:
    """A failed launch group as a check: "rank k raised" (a regression) when its root cause raised
    from the system under test, else an infrastructure error."""
    checks = []
    for r in launches:
        if r.ok:
            continue
        if r.verdict is not None and r.verdict.kind == REGRESSION:
            root = r.root
            extra = {"traceback": root.traceback, "log": root.log, "error": r.error}
            checks.append(CheckResult(f"rank {root.rank} raised", "rank-raised", "fail", r.headline, extra=extra))
        else:
            checks.append(
                CheckResult(f"launch: {r.group.name}", "launch", "error", r.headline, extra={"error": r.error})
            )
    return checks


def record_checks(
    suite: SuiteSpec, records: dict[str, ArmRecords], pin: CpuPin | None, crashed: bool
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
    groups: list[LaunchGroup],
    launches: list[LaunchResult],
    records: dict[str, ArmRecords],
    golden: GoldenPlan,
    pin: CpuPin | None,
) -> list[CheckResult]:
    """Rank failures first, then the records, the suite's checks and the golden's, all on whatever
    the arms recorded: a check never passes on steps that did not run, and a check of an arm that a
    failed launch never ran is not evaluated (verdict.py)."""
    failures = launch_checks(launches)
    checks = record_checks(suite, records, pin, crashed=bool(failures))
    for check in suite.checks:
        checks += run_check(check, suite, records)
    if golden.mode == "check":
        checks += golden_checks(golden, {arm: rec.metrics for arm, rec in records.items()}, suite.steps)
    elif golden.mode == "off":
        checks.append(CheckResult("golden", "golden", "skip", golden.note or "not compared"))
    checks = mark_not_evaluated(checks, unrun_arms(suite, groups, launches, records))
    return [*failures, *apply_expectations(suite, checks)]


def update_golden(plan: GoldenPlan, suite: SuiteSpec, manifest: dict, metrics: dict[str, pd.DataFrame]) -> str:
    """Writes the run's trajectories as the golden (atomically); returns the diff for the reviewer."""
    provenance = {
        "torch": manifest["versions"]["torch"],
        "device": manifest["device_class"],
        "backend": manifest["backend"],
        "dtype": suite_dtype(suite),
        "harness": manifest["versions"]["harness"],
        "git_sha": manifest["versions"]["git_sha"],
        "date": manifest["created"],
    }
    new = golden_from_metrics(
        suite.name,
        manifest["env_key"],
        provenance,
        golden_config(suite),
        suite.golden_tier,
        metrics,
        suite.golden_metrics,
    )
    write_golden(plan.path, new)
    return "\n".join(filter(None, [plan.note, diff_summary(plan.golden, new), f"wrote {plan.shown(plan.path)}"]))


def cancelled_check(cancelled: Cancelled, elapsed_s: float) -> CheckResult:
    detail = (
        f"{cancelled}: the run stopped after {elapsed_s:.1f} s; every step recorded until then is"
        " kept under arms/ (summary.arms says how many)"
    )
    return CheckResult("cancelled", "cancelled", "error", detail)


def mark_cancelled(summary: dict, cancelled: Cancelled) -> None:
    """A signal after the checks ran: the run ends cancelled, its checks kept for the record."""
    check = cancelled_check(cancelled, summary["duration_s"])
    summary.update(verdict="cancelled", exit_code=cancelled.exit_code, checks=[*summary["checks"], check.to_dict()])
    summary["counts"]["error"] += 1


def execute(
    run_dir: Path,
    suite: SuiteSpec,
    groups: list[LaunchGroup],
    timeout_s: float,
    pin: CpuPin | None,
    golden: GoldenPlan,
    launches: list[LaunchResult],
    out: TextIO,
    err: TextIO,
    phases: PhaseLog,
    verbose: bool = False,
    launch: GroupLauncher = launch_group,
) -> tuple[Cancelled | None, dict[str, ArmRecords], list[CheckResult]]:
    """Launches the groups (appending to ``launches``) and checks what they recorded.

    Returns the cancellation, if a signal came, the records and the checks: on a cancellation
    only that; on an error inside the harness only that, since the outcome is then unknown.
    """
    records: dict[str, ArmRecords] = {}
    start = time.monotonic()
    try:
        env = pin.env if pin else {}
        for result in launch_all(run_dir, suite, groups, timeout_s, env, out, phases, verbose, launch):
            launches.append(result)
            if result.error:
                print(f"error: {result.error}", file=err)
        with phases.phase("judge"):
            if suite.throughput:
                return None, records, [*launch_checks(launches), judge_throughput(suite, run_dir, groups)]
            records = {arm: read_arm(run_dir, arm, suite.arms[arm].logical_ranks) for arm in suite.arms}
            return None, records, collect_checks(suite, groups, launches, records, golden, pin)
    except Cancelled as c:
        return c, records, [cancelled_check(c, time.monotonic() - start)]
    except Exception as e:
        log.exception("internal error while running the suite")
        internal = CheckResult("harness", "internal-error", "error", f"internal error: {type(e).__name__}: {e}")
        return None, records, [internal]


@dataclass(frozen=True)
class PreparedRun:
    """A run directory whose manifest is written, and what launching and judging it need; made by
    ``prepare_run`` before a launch, or read back from the run directory (``harness collect``)."""

    run_dir: Path
    suite: SuiteSpec
    options: RunOptions
    key: str
    pin: CpuPin | None
    golden: GoldenPlan
    groups: list[LaunchGroup]
    manifest: dict
    phases: PhaseLog  # the harness process's own (phases.py): start and prepare so far


def plan_groups(suite: SuiteSpec) -> list[LaunchGroup]:
    """The launch groups of a suite, in the order they run."""
    return plan_throughput_launches(suite) if suite.throughput else plan_launches(suite)


def prepare_run(
    suite: SuiteSpec, options: RunOptions, out: TextIO = sys.stdout, local_devices: bool = True
) -> PreparedRun:
    """Validates what can be validated before launching, then creates the run directory and writes
    manifest.json. Raises UsageError or GoldenError (exit 2); nothing has run then.
    ``local_devices``: the ranks run here, so this machine must have their GPUs (not so on Slurm)."""
    began = time.time()
    if local_devices:
        check_device(suite, options.device)
    pin = cpu_pin(options.cpu_isa) if options.device == "cpu" else None
    key = run_env_key(options.device, suite_dtype(suite), pin)
    if suite.throughput and options.golden == "update":
        raise UsageError(f"suite {suite.name}: a throughput run records no golden")
    golden = plan_golden(
        suite.name,
        golden_config(suite),
        key,
        "off" if suite.throughput else options.golden,
        options.golden_dir,
        suite.golden_cross_env,
    )
    if suite.throughput:
        golden = dataclasses.replace(golden, note=None)  # nothing to say: step times have no golden
    run_dir = make_run_dir(suite, options.out)
    with harness_log(run_dir), Cancellation():
        trace_cache, cache_note = usable_trace_cache(options.trace_cache, suite_subject(suite))
        options = dataclasses.replace(options, trace_cache=trace_cache)
        groups = plan_groups(suite)
        manifest = build_manifest(suite, options, key, pin, golden, groups)
        write_json_atomic(run_dir / MANIFEST, manifest)
        for line in filter(None, [pin.note if pin else None, golden.note, cache_note]):
            print(line, file=out)
            log.info(line)
    phases = PhaseLog()
    phases.add("start", harness.IMPORTED_AT, began)  # the interpreter's imports, the command line, the suite
    phases.add("prepare", began, time.time())
    return PreparedRun(run_dir, suite, options, key, pin, golden, groups, manifest, phases)


def read_prepared(run_dir: Path, suite: SuiteSpec, options: RunOptions) -> PreparedRun:
    """A prepared run read back from its manifest.json (``harness collect``), ``suite`` being the
    suite loaded again: it must be the one the manifest recorded, or the judging would differ."""
    try:
        manifest = json.loads((run_dir / MANIFEST).read_text())
        recorded, launches, golden = manifest["suite"], manifest["launches"], manifest["golden"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{run_dir}: not a readable run directory: {e}") from None
    groups = plan_groups(suite)
    if _plain({**suite.to_dict(), "path": None}) != {**recorded, "path": None} or _plain(
        [dataclasses.asdict(g) for g in groups]
    ) != _plain(launches):
        raise UsageError(
            f"{run_dir}: suite {suite.path} is not what the run recorded in manifest.json (changed since?)"
        )
    compared = golden["compared"]
    recorded_golden = load_golden(Path(compared)) if compared else None
    root = Path(golden["root"]) if golden["root"] else None
    plan = GoldenPlan(golden["mode"], Path(golden["path"]), recorded_golden, golden["tier"], golden["note"], root)
    pin = CpuPin(**manifest["cpu_isa"]) if manifest["cpu_isa"] else None
    options = dataclasses.replace(options, device=manifest["device"], command=tuple(manifest["command"]))
    phases = PhaseLog()
    phases.add("start", harness.IMPORTED_AT, time.time())
    return PreparedRun(run_dir, suite, options, manifest["env_key"], pin, plan, groups, manifest, phases)


def _plain(value: object) -> object:
    """``value`` as JSON reads it back (tuples become lists): to compare with a recorded one."""
    return json.loads(json.dumps(value))


def run_suite(suite: SuiteSpec, options: RunOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Runs a validated suite end to end and returns the exit code; raises UsageError or
    GoldenError (exit 2) before launching."""
    return judge_run(prepare_run(suite, options, out), launch_group, out, err)


def judge_run(run: PreparedRun, launch: GroupLauncher, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Launches a prepared run's groups with ``launch``, judges what they recorded, writes the
    summary, golden update and reports, and returns the exit code: one path for every launcher."""
    run_dir, suite, golden = run.run_dir, run.suite, run.golden
    import_in_background()  # the report's matplotlib, while the ranks run
    with harness_log(run_dir), Cancellation():
        start = time.monotonic()
        launches: list[LaunchResult] = []
        options = run.options
        cancelled, records, checks = execute(
            run_dir,
            suite,
            run.groups,
            options.timeout_s,
            run.pin,
            golden,
            launches,
            out,
            err,
            run.phases,
            options.verbose,
            launch,
        )
        for line in cache_notes({group.name: read_rank_phases(run_dir, group.name) for group in run.groups}):
            print(line, file=out)
            log.info(line)
        if not suite.throughput:
            records = records or {arm: read_arm(run_dir, arm, suite.arms[arm].logical_ranks) for arm in suite.arms}
        verdict, exit_code = ("cancelled", cancelled.exit_code) if cancelled else verdict_of(checks)
        summary = build_summary(
            suite, verdict, exit_code, time.monotonic() - start, run.key, golden, launches, records, checks
        )
        metrics = {arm: rec.metrics for arm, rec in records.items() if rec.steps_done()}
        news = summary["golden"]["outcome"]
        if golden.mode == "update":
            news = f"not updating {golden.shown(golden.path)}: the run did not pass"
            try:
                news = update_golden(golden, suite, run.manifest, metrics) if exit_code == EXIT_PASS else news
            except Cancelled as c:  # the golden is replaced atomically: the old one stays
                mark_cancelled(summary, c)
                news = f"not updating {golden.shown(golden.path)}: {c}"
            summary["golden"]["outcome"] = news.splitlines()[-1]
        exit_code = finish(
            run_dir, summary, run.manifest, metrics, golden.golden if golden.mode == "check" else None, err, run.phases
        )
    print(format_verdict_table(summary), file=out)
    if news:
        print(news, file=out)
    print(f"run dir: {run_dir}", file=out)
    return exit_code


def build_summary(
    suite: SuiteSpec,
    verdict: str,
    exit_code: int,
    duration_s: float,
    key: str,
    golden: GoldenPlan,
    launches: list[LaunchResult],
    records: dict[str, ArmRecords],
    checks: list[CheckResult],
) -> dict:
    """summary.json (ARCHITECTURE §4): the verdict, the exit code, and every check."""
    return {
        "suite": suite.name,
        "verdict": verdict,
        "exit_code": exit_code,
        "ranks": suite.ranks,
        "steps": suite.throughput.steps if suite.throughput else suite.steps,  # per block position
        "arms": {
            arm: {"ranks": spec.ranks, "ep": spec.logical_ranks}
            | ({} if suite.throughput else {"steps_completed": records[arm].steps_done()})
            for arm, spec in suite.arms.items()
            if arm in records or (suite.throughput and arm in (suite.throughput.a, suite.throughput.b))
        },
        "duration_s": round(duration_s, 3),
        "env_key": key,
        "golden": _golden_summary(golden, checks),
        "launches": [
            {
                "group": r.group.name,
                "ranks": r.group.ranks,
                "duration_s": round(r.duration_s, 3),
                "timed_out": r.timed_out,
                "error": r.error,
                "root_cause": _root_cause(r),
                **({"slurm_job": r.job} if r.job else {}),
            }
            for r in launches
        ],
        "error": "\n".join(r.error for r in launches if r.error) or None,
        "counts": status_counts([c.to_dict() for c in checks]),
        "checks": [c.to_dict() for c in checks],
        "throughput": next((c.extra["throughput"] for c in checks if c.kind == "throughput"), None),
    }


def _root_cause(result: LaunchResult) -> dict | None:
    """How a failed launch is judged, and the rank that died first (none for a timeout: all hung)."""
    if result.verdict is None:
        return None
    rank = result.root.rank if result.root and not result.timed_out else None
    return {**dataclasses.asdict(result.verdict), "rank": rank}


def finish(
    run_dir: Path,
    summary: dict,
    manifest: dict,
    metrics: dict[str, pd.DataFrame],
    golden: Golden | None,
    err: TextIO,
    phases: PhaseLog,
) -> int:
    """Writes summary.json, junit.xml, then report.html, and returns the run's exit code.

    The cheap, essential files go first, so that a second signal during the slow report leaves
    them behind. A signal arriving now turns the verdict into ``cancelled`` and writes them again;
    a report that cannot be rendered is an infrastructure error (exit 3), logged with its traceback.
    Once the report is written, summary.json is written again with the report's own time.
    """
    for attempt in range(2):
        try:
            summary["timing"] = run_timing(run_dir, phases)
            write_json_atomic(run_dir / SUMMARY, summary)
            with phases.phase("report"):
                write_reports(run_dir, summary, metrics, golden, manifest, read_throughput(run_dir))
            summary["timing"] = run_timing(run_dir, phases)
            write_json_atomic(run_dir / SUMMARY, summary)
            return summary["exit_code"]
        except Cancelled as c:
            mark_cancelled(summary, c)
        except Exception as e:
            log.exception("writing the run's outputs failed")
            print(
                f"error: writing the outputs failed: {type(e).__name__}: {e} (see {run_dir}/logs/harness.log)", file=err
            )
            if summary["exit_code"] in (EXIT_PASS, EXIT_FAIL) and attempt == 0:
                check = CheckResult(
                    "outputs", "outputs", "error", f"writing the outputs failed: {type(e).__name__}: {e}"
                )
                summary.update(verdict="error", exit_code=EXIT_INFRA, checks=[*summary["checks"], check.to_dict()])
                summary["counts"]["error"] += 1
                continue
            return EXIT_INFRA
    return summary["exit_code"]


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
    """junit.xml, then report.html (the slow one), from a run's summary and records."""
    with naming_file(run_dir / JUNIT):
        write_junit(run_dir / JUNIT, summary)
    with naming_file(run_dir / REPORT):
        write_html(
            run_dir / REPORT,
            summary,
            metrics,
            golden=golden_frames(golden),
            manifest=manifest,
            throughput=throughput,
        )


def golden_frames(golden: Golden | None) -> dict[str, pd.DataFrame] | None:
    """A golden as the report wants it: arm -> step-indexed DataFrame."""
    if golden is None:
        return None
    return {arm: pd.DataFrame(metrics) for arm, metrics in golden.arms.items()}


def rerender(run_dir: Path, out: TextIO = sys.stdout) -> int:
    """``harness report RUN_DIR``: rebuild report.html and junit.xml from what the run left."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
        manifest = json.loads((run_dir / MANIFEST).read_text())
        metrics = {
            arm: read_metrics(arm_files(run_dir, arm).metrics)
            for arm in manifest["suite"]["arms"]
            if arm_files(run_dir, arm).metrics.is_file()
        }
        compared = manifest["golden"].get("compared")
        golden = load_golden(Path(compared)) if compared and os.path.isfile(compared) else None
        throughput = read_throughput(run_dir)
    except (OSError, ValueError, KeyError, TypeError, RecordError, GoldenError) as e:
        raise UsageError(f"{run_dir}: not a readable run directory: {e}") from None
    write_reports(run_dir, summary, metrics, golden, manifest, throughput)
    print(format_verdict_table(summary), file=out)
    print(f"run dir: {run_dir}", file=out)
    return EXIT_PASS
