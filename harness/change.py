"""A change as what a run judges: every arm of a suite at two revisions of its subject's code.

``harness run SUITE --base REV [--head REV] [--source PATH]`` materialises both revisions of the
subject's package (harness/revisions.py; the head defaults to the working tree as it is) and runs
each arm twice: ``ARM@base`` in launches whose ranks import the base's package, and ``ARM`` itself
at the head. The suite's own checks and its golden judge the head arms as a plain run would; one
``change`` check per arm compares it with itself at base, at the suite's ``[change]`` tier
(harness/checks/change.py). ``harness abba SUITE --base REV --arm A`` times ``A@base`` against
``A`` in ABBA blocks instead.

The summary, the console and the report open with one line saying what was compared and how it came
out (:func:`change_line`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from harness.checks import run_check
from harness.checks.change import KIND, change_check
from harness.checks.golden import KIND as GOLDEN
from harness.records import RunRecords
from harness.results import BASE_FAILS, CHANGE, CheckResult
from harness.revisions import (
    BASE,
    HEAD,
    Revision,
    default_cache_dir,
    find_source,
    materialise,
    subject_package,
)
from harness.specs import CheckSpec, SuiteSpec
from harness.subject import load_subject


@dataclass(frozen=True)
class ChangeRequest:
    """``--base REV``, ``--head REV`` (None: the working tree) and ``--source PATH`` (None: the
    checkout the subject's package is imported from)."""

    base: str
    head: str | None = None
    source: Path | None = None
    cache: Path | None = None  # default: revisions.default_cache_dir()


def base_arm(arm: str) -> str:
    """The name of ``arm`` at the base revision."""
    return f"{arm}@{BASE}"


def prepare_change(suite: SuiteSpec, request: ChangeRequest) -> tuple[SuiteSpec, dict[str, Revision]]:
    """The suite with its arms at both revisions, and the revisions by label; RevisionError (exit 2)
    or RevisionBuildError (exit 3) before anything is launched."""
    subject = load_subject(suite.subject, suite.path.resolve())
    package = subject_package(subject, suite.subject)
    source = find_source(package, suite.subject, request.source)
    cache = request.cache or default_cache_dir()
    revisions = {
        BASE: materialise(source, BASE, request.base, "--base", cache),
        HEAD: materialise(source, HEAD, request.head, "--head", cache),
    }
    return change_suite(suite), revisions


def change_suite(suite: SuiteSpec) -> SuiteSpec:
    """Every arm at head (its own name) and at base (``ARM@base``), with a ``change`` check each; a
    throughput suite times its arm ``a`` at base against itself at head."""
    if suite.throughput is not None:
        arm = suite.arms[suite.throughput.a]
        arms = {
            base_arm(arm.name): dataclasses.replace(arm, name=base_arm(arm.name), revision=BASE),
            arm.name: dataclasses.replace(arm, revision=HEAD),
        }
        spec = dataclasses.replace(suite.throughput, a=base_arm(arm.name), b=arm.name)
        return dataclasses.replace(suite, arms=arms, throughput=spec)
    head = {name: dataclasses.replace(arm, revision=HEAD) for name, arm in suite.arms.items()}
    base = {base_arm(name): dataclasses.replace(arm, name=base_arm(name), revision=BASE) for name, arm in head.items()}
    checks = tuple(change_check(name, base_arm(name), suite.change_tier) for name in head)
    return dataclasses.replace(suite, arms={**head, **base}, checks=(*suite.checks, *checks))


def judge_change(
    results: list[CheckResult],
    checks: list[CheckSpec],
    suite: SuiteSpec,
    records: RunRecords,
    revisions: dict[str, Revision],
    launched: bool,
) -> tuple[list[CheckResult], str]:
    """A change check's results, a failure the base shares labelled so (:func:`blame_base`; not in a
    throughput run, whose gate is the only check), and the line the run opens with (:func:`change_line`;
    ``launched``: every launch ended well, else nothing is compared)."""
    if suite.throughput is None:
        results = blame_base(results, checks, suite, records)
    if not launched:
        return results, f"{sides_of(revisions)}: not compared: a launch failed"
    return results, change_line(revisions, results, suite)


def sides_of(revisions: dict[str, Revision]) -> str:
    """``head (abc1234, +dirty) vs base main (def5678)``."""
    return f"head {revisions[HEAD].describe()} vs base {revisions[BASE].describe()}"


def blame_base(
    results: list[CheckResult], checks: list[CheckSpec], suite: SuiteSpec, records: RunRecords
) -> list[CheckResult]:
    """The suite's own and its golden's check results at head, each failure that its check also fails
    on the base arms labelled BASE_FAILS: the base itself fails the suite, and the change is not blamed
    for it. A golden the head fails and the base matches is labelled CHANGE: the change moved it."""
    failing = {r.name for r in results if r.status == "fail" and r.kind != KIND}
    if not failing:
        return results
    head = [arm for arm, spec in suite.arms.items() if spec.revision != BASE]
    at_base = RunRecords({arm: records[base_arm(arm)] for arm in head if base_arm(arm) in records})
    own = [check for check in checks if check.kind != KIND]
    base_failed = {r.name for check in own for r in run_check(check, suite, at_base) if r.status == "fail"}
    blamed = []
    for r in results:
        if r.name in failing and r.name in base_failed:
            r = dataclasses.replace(r, label=BASE_FAILS, detail=f"{r.detail}; it fails at the base too")
        elif r.name in failing and r.kind == GOLDEN:
            r = dataclasses.replace(r, label=CHANGE, detail=f"{r.detail}; the base matches it: the change moved it")
        blamed.append(r)
    return blamed


def change_line(revisions: dict[str, Revision], checks: list[CheckResult], suite: SuiteSpec) -> str:
    """``head (abc1234, +dirty) vs base main (def5678): 20 steps bitwise identical on 3 arms``, or
    which arm parts first, where; for a throughput run, what its gate found."""
    sides = sides_of(revisions)
    ours = [c for c in checks if c.kind == KIND]
    if not ours:
        gate = next((c for c in checks if c.kind == "throughput"), None)
        return f"{sides}: {gate.detail if gate else 'nothing compared'}"
    arms = len({c.arms[-1] for c in ours})
    failed = [c for c in ours if c.status == "fail"]
    if failed:
        first = min(failed, key=lambda c: c.first_divergent_step or suite.steps + 1)
        differ = f"{len({c.arms[-1] for c in failed})} of {arms} arm{'s' if arms != 1 else ''} differ"
        return f"{sides}: {differ}; {first.name}: {first.detail}"
    if any(c.status != "pass" for c in ours):
        return f"{sides}: not judged ({', '.join(sorted({c.status for c in ours if c.status != 'pass'}))})"
    tier = suite.change_tier["kind"]
    how = "bitwise identical" if tier == "exact" else f"within the {tier} tier"
    return f"{sides}: {suite.steps} steps {how} on {arms} arm{'s' if arms != 1 else ''}"
