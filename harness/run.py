"""One ``harness run``: suite -> launches -> records -> checks -> golden -> summary, report, junit -> exit code.

Exit codes are the CI contract: 0 every check passed, 1 a check failed (a regression),
2 bad usage, suite or input (nothing was launched), 3 infrastructure (a rank crashed or hung,
a timeout, a launch failure: a flake, or a crash to look at). Whatever happens after the run
directory exists, summary.json, report.html and junit.xml are written, and partial records
stay on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import pandas as pd
import torch
import torch.distributed as dist

import harness
from harness.compare import CheckResult, Exact, compare_arms, tier_from_spec
from harness.golden import (
    Golden,
    GoldenError,
    compare_to_golden,
    diff_summary,
    env_key,
    golden_from_metrics,
    load_golden,
    write_golden,
)
from harness.invariants import (
    check_correction_stats,
    check_exactly_once,
    check_planned_exchanges,
    check_same_event_sequence,
    check_staleness_ages,
    pipeline_plan,
    training_plan,
)
from harness.launch import LaunchGroup, LaunchResult, launch_group, plan_launches
from harness.records import RecordError, read_jsonl, read_metrics, write_json_atomic
from harness.report import format_verdict_table, write_html, write_junit
from harness.suites import GRAPH_KIND, PIPELINE_KINDS, ArmSpec, CheckSpec, SuiteSpec

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3
REPO_ROOT = Path(__file__).resolve().parent.parent
REPORTS_DIR = REPO_ROOT / "reports"
GOLDEN_DIR = REPO_ROOT / "golden"
GOLDEN_MODES = ("auto", "check", "update", "off")


class UsageError(Exception):
    """Bad usage or input detected before launching; one line, exit code 2."""


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"
    out: Path | None = None
    timeout_s: float = 600.0
    golden: str = "auto"  # auto: check when a golden exists for the environment key
    golden_dir: Path = GOLDEN_DIR
    command: tuple[str, ...] = ()


# --- environment ---------------------------------------------------------------------------


def git_sha() -> str:
    """HEAD of the harness checkout, "-dirty" when it has local changes; "unknown" outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__, "harness": harness.__version__, "git_sha": git_sha()}


def device_class(device: str) -> str:
    """"cpu-<ISA>" such as "cpu-avx512", or "cuda-<gpu model>" such as "cuda-h200".

    Numerics differ between GPU models, and on CPUs between the vector ISAs that torch's
    kernels dispatch to; a golden recorded on one is not owed by the other.
    """
    if device != "cuda":
        return "cpu-" + torch.backends.cpu.get_cpu_capability().lower()
    return "cuda-" + torch.cuda.get_device_name(0).lower().removeprefix("nvidia ").split()[0]


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def suite_dtype(suite: SuiteSpec) -> str:
    return "+".join(sorted({arm.train["dtype"] for arm in suite.arms.values()}))


def suite_env_key(suite: SuiteSpec, device: str) -> str:
    return env_key(device_class(device), backend_for(device), suite_dtype(suite), torch.__version__)


def config_sha(suite: SuiteSpec) -> str:
    """Fingerprint of what the suite asks for (arms, processes, non-default configs), steps excluded.

    Non-default fields only: a field the reference adds later leaves goldens comparable, while a
    changed default moves the numerics and shows up as a golden failure, as it should.
    """
    arms = {a.name: {"ranks": a.ranks, "config": a.non_defaults()} for a in suite.arms.values()}
    return hashlib.sha256(json.dumps(arms, sort_keys=True).encode()).hexdigest()[:16]


def check_device(suite: SuiteSpec, device: str) -> None:
    if device != "cuda":
        return
    needed = max(arm.ranks for arm in suite.arms.values())
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise UsageError(f"--device cuda: suite {suite.name} needs {needed} GPUs (one per rank), {have} visible")


# --- run directory -------------------------------------------------------------------------


def make_run_dir(suite: SuiteSpec, out: Path | None) -> Path:
    """``--out DIR`` (new or empty), else reports/<suite>/<UTC timestamp>[-n], never reused."""
    if out is not None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UsageError(f"--out {out}: exists and is not an empty directory")
        out.mkdir(parents=True, exist_ok=True)
        return out
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = REPORTS_DIR / suite.name
    base.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UsageError(f"{base}: cannot create a run directory for {stamp}")


# --- progress ------------------------------------------------------------------------------


class Progress:
    """Per-arm "step k/N", read from the metrics.jsonl the ranks stream.

    On a terminal one line per arm is redrawn in place; otherwise each step is a plain line.
    """

    def __init__(self, run_dir: Path, arms: list[str], steps: int, stream: TextIO = sys.stdout) -> None:
        self.run_dir, self.arms, self.steps, self.stream = run_dir, arms, steps, stream
        self.tty = stream.isatty()
        self._offsets = dict.fromkeys(arms, 0)
        self._done: dict[str, int] = dict.fromkeys(arms, 0)
        self._open_line = False

    def tick(self) -> None:
        for arm in self.arms:
            for record in self._new_records(arm):
                self._done[arm] = int(record.get("step", self._done[arm] + 1))
                self._show(arm, record)

    def _new_records(self, arm: str) -> list[dict]:
        path = self.run_dir / "arms" / arm / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._offsets[arm])
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next tick
        self._offsets[arm] += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def _show(self, arm: str, record: dict) -> None:
        line = f"[arm {arm}] step {self._done[arm]}/{self.steps} loss={record.get('loss')} grad_norm={record.get('grad_norm')}"
        if not self.tty:
            print(line, file=self.stream, flush=True)
            return
        finished = self._done[arm] >= self.steps
        self.stream.write("\r\033[K" + line + ("\n" if finished else ""))
        self.stream.flush()
        self._open_line = not finished

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


# --- reading the records -------------------------------------------------------------------


@dataclass
class ArmRecords:
    metrics: pd.DataFrame | None = None
    updates: list[dict] = field(default_factory=list)  # metrics.jsonl as written: null and NaN kept apart
    events: dict[int, list[dict]] = field(default_factory=dict)
    moe_layers: list[int] = field(default_factory=list)
    graph_checks: list[dict] = field(default_factory=list)  # static checks of a traced arm's graph
    error: str | None = None  # unreadable records

    def steps_done(self) -> int:
        return 0 if self.metrics is None else len(self.metrics)


def read_arm(run_dir: Path, suite: SuiteSpec, arm: str) -> ArmRecords:
    arm_dir = run_dir / "arms" / arm
    records = ArmRecords()
    try:
        if (arm_dir / "metrics.jsonl").is_file():
            records.metrics = read_metrics(arm_dir / "metrics.jsonl")
            records.updates = read_jsonl(arm_dir / "metrics.jsonl")
        if (arm_dir / "arm.json").is_file():
            arm_info = json.loads((arm_dir / "arm.json").read_text())
            records.moe_layers = arm_info["moe_layers"]
            records.graph_checks = arm_info.get("graph_checks", [])
        for logical_rank in range(suite.arms[arm].ep):
            path = arm_dir / f"events.rank{logical_rank}.jsonl"
            records.events[logical_rank] = read_jsonl(path) if path.is_file() else []
    except (RecordError, OSError, ValueError, KeyError) as e:
        records.error = f"unreadable records of arm '{arm}': {e}"
    return records


# --- checks --------------------------------------------------------------------------------


def _same_events(name: str, a: ArmRecords, b: ArmRecords, label_a: str, label_b: str) -> CheckResult:
    """check_same_event_sequence on every logical rank; the first rank that differs is reported."""
    results = {
        rank: check_same_event_sequence(a.events.get(rank, []), b.events.get(rank, []), label_a=label_a, label_b=label_b)
        for rank in sorted(a.events.keys() | b.events.keys())
    }
    bad = next((r for r in results.values() if r.status != "pass"), None)
    if bad is not None:
        rank = next(k for k, v in results.items() if v is bad)
        return dataclasses.replace(bad, name=name, detail=f"logical rank {rank}: {bad.detail}")
    total = sum(len(events) for events in a.events.values())
    return CheckResult(name, "same-event-sequence", "pass", f"{total} events identical on all {len(results)} logical ranks")


def exchange_plan(arm: ArmSpec, steps: list[int]) -> dict[tuple[int, str], int]:
    """The exchanges an arm's events must show: per step of plain training, per tick of a pipeline."""
    if not arm.versioned:
        return training_plan(steps)
    train = arm.train
    replay, always = train["retention"] == "replay", train["correction"] == "always"
    return pipeline_plan(len(steps), train["delay"], replay=replay, always_correct=always)


def pipeline_check(kind: str, updates: list[dict], train: dict[str, Any], steps: int) -> CheckResult:
    """One version-protocol check on a versioned arm's update records.

    Batches are numbered like steps (see worker.updates): a run of N steps applies batches 1..N.
    """
    if kind == "exactly-once":
        return check_exactly_once(updates, range(1, steps + 1))
    if kind == "staleness-ages":
        return check_staleness_ages(updates, train["delay"])
    return check_correction_stats(updates, train["correction"])


def graph_results(arm: str, graph_checks: list[dict]) -> list[CheckResult]:
    """The static checks the rank recorded for a traced arm's graph; none recorded is a failure."""
    if not graph_checks:
        return [CheckResult(f"{arm}: {GRAPH_KIND}", GRAPH_KIND, "fail", "the arm recorded no static graph checks")]
    return [
        CheckResult(f"{arm}: {c['name']}", GRAPH_KIND, c["status"], c["detail"], extra={"problems": c["problems"]})
        for c in graph_checks
    ]


def run_check(check: CheckSpec, suite: SuiteSpec, records: dict[str, ArmRecords]) -> list[CheckResult]:
    """The results of one [[checks]] entry; arms that did not finish make it a skip."""
    unfinished = [arm for arm in check.arms if records[arm].error or records[arm].steps_done() < suite.steps]
    if unfinished:
        reason = "; ".join(records[a].error or f"arm '{a}' finished {records[a].steps_done()} of {suite.steps} steps" for a in unfinished)
        return [CheckResult(check.name, check.kind, "skip", f"not run: {reason}")]
    if check.kind == "token-exchange-invariants":
        results = []
        for arm in check.arms:
            train = suite.arms[arm].train
            chunks = train["chunks"] if train["chunking"] != "none" else 1
            plan = exchange_plan(suite.arms[arm], records[arm].metrics.index.tolist())
            for r in check_planned_exchanges(records[arm].events, plan=plan, moe_layers=records[arm].moe_layers, chunks=chunks):
                results.append(dataclasses.replace(r, name=f"{arm}: {r.name}"))
        return results
    if check.kind in PIPELINE_KINDS:
        return [
            dataclasses.replace(
                pipeline_check(check.kind, records[arm].updates, suite.arms[arm].train, suite.steps), name=f"{arm}: {check.name}"
            )
            for arm in check.arms
        ]
    if check.kind == GRAPH_KIND:
        return [result for arm in check.arms for result in graph_results(arm, records[arm].graph_checks)]
    a, b = check.arms
    if check.kind == "same-event-sequence":
        return [_same_events(check.name, records[a], records[b], a, b)]
    tier = Exact() if check.kind == "determinism" else tier_from_spec(check.tier)
    results = [
        dataclasses.replace(
            compare_arms(f"{check.name}: {metric}", records[a].metrics, records[b].metrics, metric, tier, a, b), kind=check.kind
        )
        for metric in check.metrics
    ]
    if check.kind == "determinism":
        results.append(dataclasses.replace(_same_events(f"{check.name}: events", records[a], records[b], a, b), kind=check.kind))
    return results


# --- goldens -------------------------------------------------------------------------------


@dataclass
class GoldenPlan:
    mode: str  # check | update | off
    path: Path
    existing: Golden | None = None
    note: str | None = None  # why an update ignores an unreadable previous golden


def plan_golden(suite: SuiteSpec, key: str, requested: str, golden_dir: Path) -> GoldenPlan:
    """Resolves --golden before launching, so a corrupt or mismatched golden costs no run (exit 2)."""
    path = golden_dir / suite.name / f"{key}.json"
    mode = ("check" if path.is_file() else "off") if requested == "auto" else requested
    if mode == "off":
        return GoldenPlan(mode, path)
    if mode == "check" and not path.is_file():
        raise UsageError(f"--golden check: no golden at {path}; record one with: harness golden update {suite.name}")
    try:
        existing = load_golden(path) if path.is_file() else None
        if existing is not None and existing.suite != suite.name:
            raise GoldenError(path, "suite", f"golden is for suite {existing.suite!r}, not {suite.name!r}")
    except GoldenError as e:
        if mode == "check":
            raise UsageError(str(e)) from None
        return GoldenPlan(mode, path, note=f"replacing an unreadable golden: {e}")
    return GoldenPlan(mode, path, existing)


def golden_checks(plan: GoldenPlan, suite: SuiteSpec, metrics: dict[str, pd.DataFrame]) -> list[CheckResult]:
    """Compares on the steps both the golden and the run have; a golden of another configuration is skipped."""
    golden = plan.existing
    recorded = golden.provenance.get("config_sha")
    if recorded != config_sha(suite):
        detail = (
            f"not compared: {plan.path} was recorded for another configuration"
            f" (config_sha {recorded}, this run {config_sha(suite)}: --ranks or --set differ)"
        )
        return [CheckResult("golden", "golden", "skip", detail)]
    last = min(suite.steps, min(int(s.index.max()) for m in golden.arms.values() for s in m.values()))
    trimmed = dataclasses.replace(
        golden, arms={arm: {m: s[s.index <= last] for m, s in ms.items()} for arm, ms in golden.arms.items()}
    )
    run = {arm: frame[frame.index <= last] for arm, frame in metrics.items()}
    return compare_to_golden(trimmed, run, tier_from_spec(suite.golden_tier))


def update_golden(plan: GoldenPlan, suite: SuiteSpec, key: str, manifest: dict, metrics: dict[str, pd.DataFrame]) -> str:
    """Writes the run's trajectories as the golden (atomically); returns the diff for the reviewer."""
    provenance = {
        "torch": manifest["versions"]["torch"],
        "device": manifest["device_class"],
        "backend": manifest["backend"],
        "dtype": suite_dtype(suite),
        "harness": manifest["versions"]["harness"],
        "git_sha": manifest["versions"]["git_sha"],
        "date": manifest["created"],
        "config_sha": config_sha(suite),
        "steps": str(suite.steps),
    }
    new = golden_from_metrics(suite.name, key, provenance, suite.golden_tier, metrics, metrics_names=suite.golden_metrics)
    write_golden(plan.path, new)
    return "\n".join(filter(None, [plan.note, diff_summary(plan.existing, new), f"wrote {plan.path}"]))


# --- the run -------------------------------------------------------------------------------


def verdict_of(checks: list[CheckResult]) -> tuple[str, int]:
    statuses = {c.status for c in checks}
    if "error" in statuses:
        return "error", EXIT_INFRA
    if "fail" in statuses:
        return "fail", EXIT_FAIL
    return "pass", EXIT_PASS


def golden_frames(golden: Golden | None) -> dict[str, pd.DataFrame] | None:
    """A golden as the report wants it: arm -> step-indexed DataFrame."""
    if golden is None:
        return None
    return {arm: pd.DataFrame(metrics) for arm, metrics in golden.arms.items()}


def build_manifest(suite: SuiteSpec, options: RunOptions, key: str, golden: GoldenPlan, groups: list[LaunchGroup]) -> dict:
    return {
        "command": list(options.command),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "suite": suite.to_dict(),
        "versions": versions(),
        "device": options.device,
        "device_class": device_class(options.device),
        "backend": backend_for(options.device),
        "ranks": suite.ranks,
        "seed": sorted({arm.train["seed"] for arm in suite.arms.values()}),
        "env_key": key,
        "config_sha": config_sha(suite),
        "launches": [dataclasses.asdict(g) for g in groups],
        "golden": {"mode": golden.mode, "path": str(golden.path)},
        "timeout_s": options.timeout_s,
    }


def launch_all(run_dir: Path, suite: SuiteSpec, groups: list[LaunchGroup], timeout_s: float, out: TextIO) -> list[LaunchResult]:
    """Launch groups one after another under one deadline; the first failure ends the run."""
    deadline = time.monotonic() + timeout_s
    progress = Progress(run_dir, list(suite.arms), suite.steps, out)
    launches: list[LaunchResult] = []
    for group in groups:
        launches.append(launch_group(run_dir, group, deadline=deadline, timeout_s=timeout_s, tick=progress.tick))
        if not launches[-1].ok:
            break
    progress.close()
    return launches


def collect_checks(
    suite: SuiteSpec, launches: list[LaunchResult], records: dict[str, ArmRecords], golden: GoldenPlan
) -> list[CheckResult]:
    """Infrastructure errors first, then the suite's checks, then the golden's."""
    checks = [
        CheckResult(f"launch: {r.group.name}", "launch", "error", r.headline, extra={"error": r.error}) for r in launches if r.error
    ]
    checks += [CheckResult(f"records: {arm}", "records", "error", rec.error) for arm, rec in records.items() if rec.error]
    complete = not checks and all(rec.steps_done() == suite.steps for rec in records.values())
    for check in suite.checks:
        checks += run_check(check, suite, records)
    if golden.mode == "check" and complete:
        checks += golden_checks(golden, suite, {arm: rec.metrics for arm, rec in records.items()})
    elif golden.mode == "check":
        checks.append(CheckResult("golden", "golden", "skip", "not run: the run is incomplete"))
    return checks


def run_suite(suite: SuiteSpec, options: RunOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Runs a validated suite end to end and returns the exit code; raises UsageError before launching."""
    check_device(suite, options.device)
    key = suite_env_key(suite, options.device)
    golden = plan_golden(suite, key, options.golden, options.golden_dir)
    run_dir = make_run_dir(suite, options.out)
    groups = plan_launches(suite)
    manifest = build_manifest(suite, options, key, golden, groups)
    write_json_atomic(run_dir / "manifest.json", manifest)

    start = time.monotonic()
    launches = launch_all(run_dir, suite, groups, options.timeout_s, out)
    for result in launches:
        if result.error:
            print(f"error: {result.error}", file=err)
    records = {arm: read_arm(run_dir, suite, arm) for arm in suite.arms}
    checks = collect_checks(suite, launches, records, golden)
    verdict, exit_code = verdict_of(checks)
    metrics = {arm: rec.metrics for arm, rec in records.items() if rec.metrics is not None}
    golden_news = None
    if golden.mode == "update":
        passed = exit_code == EXIT_PASS
        golden_news = update_golden(golden, suite, key, manifest, metrics) if passed else f"not updating {golden.path}: the run did not pass"

    summary = {
        "suite": suite.name,
        "verdict": verdict,
        "exit_code": exit_code,
        "ranks": suite.ranks,
        "steps": suite.steps,
        "arms": {
            arm: {"ranks": spec.ranks, "ep": spec.ep, "steps_completed": records[arm].steps_done()} for arm, spec in suite.arms.items()
        },
        "duration_s": round(time.monotonic() - start, 3),
        "env_key": key,
        "golden": {"mode": golden.mode, "path": str(golden.path)},
        "launches": [
            {"group": r.group.name, "ranks": r.group.ranks, "duration_s": round(r.duration_s, 3), "timed_out": r.timed_out, "error": r.error}
            for r in launches
        ],
        "error": "\n".join(r.error for r in launches if r.error) or None,
        "checks": [c.to_dict() for c in checks],
    }
    compared = golden.existing if any(c.name.startswith("golden:") for c in checks) else None
    write_outputs(run_dir, summary, manifest, metrics, compared)
    print(format_verdict_table(summary), file=out)
    if golden_news:
        print(golden_news, file=out)
    print(f"run dir: {run_dir}", file=out)
    return exit_code


def write_outputs(run_dir: Path, summary: dict, manifest: dict, metrics: dict[str, pd.DataFrame], golden: Golden | None) -> None:
    write_json_atomic(run_dir / "summary.json", summary)
    write_html(run_dir / "report.html", summary, metrics, golden=golden_frames(golden), manifest=manifest)
    write_junit(run_dir / "junit.xml", summary)


def rerender(run_dir: Path, out: TextIO = sys.stdout) -> int:
    """``harness report RUN_DIR``: rebuild report.html and junit.xml from what the run left."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        manifest = json.loads((run_dir / "manifest.json").read_text())
        metrics = {
            arm: read_metrics(run_dir / "arms" / arm / "metrics.jsonl")
            for arm in manifest["suite"]["arms"]
            if (run_dir / "arms" / arm / "metrics.jsonl").is_file()
        }
        golden_path = Path(summary["golden"]["path"])
        golden = load_golden(golden_path) if summary["golden"]["mode"] == "check" and golden_path.is_file() else None
    except (OSError, ValueError, KeyError, RecordError, GoldenError) as e:
        raise UsageError(f"{run_dir}: not a readable run directory: {e}") from None
    write_html(run_dir / "report.html", summary, metrics, golden=golden_frames(golden), manifest=manifest)
    write_junit(run_dir / "junit.xml", summary)
    print(format_verdict_table(summary), file=out)
    print(f"run dir: {run_dir}", file=out)
    return EXIT_PASS


def describe_environment() -> dict[str, Any]:
    """What ``harness doctor`` prints: versions, devices, backends, and the env key goldens use here."""
    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        **versions(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "cpus": len(os.sched_getaffinity(0)),
        "cuda": torch.version.cuda if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "backends": {name: available() for name, available in (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available), ("mpi", dist.is_mpi_available))},
        "env_key cpu": env_key("cpu", "gloo", "float32", torch.__version__),
    }
    if cuda:
        info["env_key cuda"] = env_key(device_class("cuda"), "nccl", "float32", torch.__version__)
    return info
