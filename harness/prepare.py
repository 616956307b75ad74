"""Preparing a run: everything validated that can be before a rank starts, the run directory made
and ``manifest.json`` written (:func:`prepare_run`); or a prepared run read back from its
directory (:func:`read_prepared`, for ``harness collect``). Raises UsageError or GoldenError
(exit 2) with nothing launched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import torch

import harness
from harness.base_cache import BaseRecords, reuse_base
from harness.cancel import Cancellation
from harness.environment import CpuPin, backend_for, cpu_pin, device_class, fingerprint, run_env_key, versions
from harness.golden_plan import GoldenPlan, golden_config, plan_golden, rebless_command
from harness.kinds import RunKind, run_kind
from harness.manifest import Manifest, ManifestError
from harness.phases import PhaseLog
from harness.plan import LaunchGroup
from harness.revisions import BASE, Revision
from harness.rundir import harness_log, inductor_cache, make_run_dir
from harness.shipped import shipped_dir
from harness.specs import CheckSpec, SuiteSpec
from harness.subject import Subject, subject_of, usable_trace_cache

TRACE_ENV = "HARNESS_TRACE_CACHE"
log = logging.getLogger("harness")


def default_golden_dir() -> Path:
    """The shipped goldens, or $HARNESS_GOLDEN_DIR (a CI cache, a test's empty directory) as it is
    when a command starts, not when this module was imported."""
    return Path(os.environ.get("HARNESS_GOLDEN_DIR", shipped_dir("golden")))


class UsageError(Exception):
    """Bad usage or input detected before launching; one line, exit code 2."""


@dataclass(frozen=True)
class RunOptions:
    """How to run a suite: the command line's options, validated."""

    device: str = "cpu"
    out: Path | None = None
    timeout_s: float = 600.0
    golden: str = "auto"  # auto: check when a golden applies to this environment
    golden_dir: Path = field(default_factory=default_golden_dir)
    cpu_isa: str = "avx2"  # avx2: the portable kernel pin (environment.py); native: opt out
    command: tuple[str, ...] = ()
    verbose: bool = False  # plain per-step lines on a terminal too, in place of the live display
    trace_cache: Path | None = None  # where traced arms keep their graphs (reference/chunking/trace_cache.py)
    first_op: str = "off"  # auto | on | off: locate the first op where two arms part (harness/first_op.py)
    first_op_budget_s: float = 300.0  # the re-run's time limit; auto starts it only if it should fit
    # Where the run's timeline starts: the program's start, its imports included (harness.IMPORTED_AT),
    # or when a process that imported harness long before called the command.
    started_at: float = harness.IMPORTED_AT
    # A change check's revisions of the subject's package, by label (harness/change.py); empty: none.
    revisions: dict[str, Revision] = field(default_factory=dict)


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


def check_device(suite: SuiteSpec, device: str) -> None:
    if device != "cuda":
        return
    needed = max(arm.ranks for arm in suite.arms.values())
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        raise UsageError(f"--device cuda: suite {suite.name} needs {needed} GPUs (one per rank), {have} visible")


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
    rebless: str  # the command that re-records the run's golden, for a run that fails by drift
    groups: list[LaunchGroup]
    manifest: Manifest
    phases: PhaseLog  # the harness process's own (phases.py): start and prepare so far
    subject: Subject  # the system under test (subject/protocol.py)
    kind: RunKind  # a training or a throughput run (kinds.py)
    checks: list[CheckSpec]  # what the run is judged by: the suite's and the golden's, or the gate
    env: dict[str, str]  # what every rank's environment gains: the CPU kernel pin, a private Inductor cache
    base: BaseRecords | None = None  # a change check's base records: restored, or to be kept (base_cache.py)

    @property
    def subject_source(self) -> tuple[Path, ...]:
        """The subject's code (a rank raising in there is a regression, triage.py): its own, and a
        change's revisions of its package."""
        return (*self.subject.source, *(Path(r.root) for r in self.manifest.revisions.values()))


def prepare_run(
    suite: SuiteSpec, options: RunOptions, out: TextIO = sys.stdout, local_devices: bool = True
) -> PreparedRun:
    """Validates what can be validated before launching, then creates the run directory and writes
    manifest.json. Raises UsageError or GoldenError (exit 2); nothing has run then.
    ``local_devices``: the ranks run here, so this machine must have their GPUs (not so on Slurm)."""
    began = time.time()
    if local_devices:
        check_device(suite, options.device)
    unpickled = _unpickled(suite, local_devices)
    kind = run_kind(suite)
    if not kind.records_golden and options.golden == "update":
        raise UsageError(f"suite {suite.name}: a throughput run records no golden")
    groups = kind.launches()
    pin = cpu_pin(options.cpu_isa) if options.device == "cpu" else None
    key = run_env_key(options.device, suite.dtype, pin)
    config, rebless = golden_config(suite), rebless_command(options.command, suite)
    golden = plan_golden(
        suite.name,
        config,
        key,
        options.golden if kind.records_golden else "none",
        options.golden_dir,
        suite.golden_cross_env,
        fingerprint(options.device, pin),
    )
    checks = kind.checks(golden, groups)
    run_dir = make_run_dir(suite.name, options.out, unpickled)
    # what every rank's environment gains
    env = {**(pin.env if pin else {}), **inductor_cache(run_dir, pin.capability if pin else options.device)}
    # A change check's base records, restored if kept (base_cache.py); never for a throughput run,
    # whose two sides must be timed side by side.
    base = None
    if BASE in options.revisions and kind.records_golden:
        base = reuse_base(suite, options.revisions[BASE].sha, options.revisions[BASE].package, key, run_dir)
        if base.restored:
            groups = [group for group in groups if group.revision != BASE]
    with harness_log(run_dir), Cancellation():
        subject = subject_of(suite)
        trace_cache, cache_note = usable_trace_cache(options.trace_cache, subject)
        options = dataclasses.replace(options, trace_cache=trace_cache)
        manifest = Manifest(
            command=list(options.command),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            suite=suite.to_dict(),
            versions=versions(),
            device=options.device,
            device_class=device_class(options.device, pin),
            cpu_isa=pin.to_dict() if pin else None,
            backend=backend_for(options.device),
            ranks=suite.ranks,
            seed=sorted({arm.seed for arm in suite.arms.values()}),
            env_key=key,
            golden_config=config,  # what its golden is recorded for
            launches=groups,
            golden=golden.record,
            timeout_s=options.timeout_s,
            trace_cache=str(trace_cache) if trace_cache else None,
            revisions=options.revisions,
        )
        manifest.write(run_dir)
        for line in filter(None, [pin.note if pin else None, golden.note, cache_note, base and base.line]):
            print(line, file=out)
            log.info(line)
    phases = PhaseLog()
    phases.add("start", options.started_at, began)  # the interpreter's imports, the command line, the suite
    phases.add("prepare", began, time.time())
    return PreparedRun(
        run_dir, suite, options, key, pin, golden, rebless, groups, manifest, phases, subject, kind, checks, env, base
    )


def _unpickled(suite: SuiteSpec, local_devices: bool) -> str | None:
    """What of a run is unpickled from its run directory, if anything: see make_run_dir."""
    if not local_devices:
        return "the Slurm jobs' submissions, which the nodes unpickle"
    if any(arm.resume_at for arm in suite.arms.values()):
        return "the checkpoints its resumed arms unpickle"
    return None


def read_prepared(run_dir: Path, suite: SuiteSpec, options: RunOptions) -> PreparedRun:
    """A prepared run read back from its manifest.json (``harness collect``), ``suite`` being the
    suite loaded again: it must be the one the manifest recorded, or the judging would differ."""
    try:
        manifest = Manifest.read(run_dir)
    except ManifestError as e:
        raise UsageError(f"{run_dir}: not a readable run directory: {e}") from None
    kind = run_kind(suite)
    groups = kind.launches()
    recorded = _plain({**manifest.suite, "path": None})
    if _plain({**suite.to_dict(), "path": None}) != recorded or groups != manifest.launches:
        raise UsageError(
            f"{run_dir}: suite {suite.path} is not what the run recorded in manifest.json (changed since?)"
        )
    plan = GoldenPlan.from_record(manifest.golden)
    pin = CpuPin(**manifest.cpu_isa) if manifest.cpu_isa else None
    options = dataclasses.replace(options, device=manifest.device, command=tuple(manifest.command))
    phases = PhaseLog()
    phases.add("start", options.started_at, time.time())
    subject, checks = subject_of(suite), kind.checks(plan, groups)
    env = {**(pin.env if pin else {}), **inductor_cache(run_dir, pin.capability if pin else manifest.device)}
    rebless = rebless_command(manifest.command, suite)
    return PreparedRun(
        run_dir,
        suite,
        options,
        manifest.env_key,
        pin,
        plan,
        rebless,
        groups,
        manifest,
        phases,
        subject,
        kind,
        checks,
        env,
    )


def _plain(value: object) -> object:
    """``value`` as JSON reads it back (tuples become lists): to compare with a recorded one."""
    return json.loads(json.dumps(value))
