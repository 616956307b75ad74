"""``golden``: the run's metrics against the golden trajectory recorded for its environment.

Every suite has this check, and no suite lists it: ``[golden]`` and ``--golden`` configure it
(:mod:`harness.golden` plans it before the run), and the run plans it (:func:`golden_check`),
except when ``--golden update`` records a new golden instead. With ``--golden off``, or no golden
that applies, it is one ``skip`` saying why: "skip" never passes silently.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from harness.checks.registry import CheckFamily, SuiteReader, register
from harness.compare import CheckResult, Tier, compare_arms, tier_from_spec
from harness.golden import Golden, GoldenPlan
from harness.records import RunRecords
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import METRICS

KIND = "golden"


def golden_check(plan: GoldenPlan, suite: SuiteSpec) -> CheckSpec | None:
    """The golden check of a run with ``plan`` (None when it updates the golden instead)."""
    if plan.mode == "update":
        return None
    return CheckSpec(KIND, KIND, tuple(suite.arms), options={"plan": plan})


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    raise v.error(f"{dotted}.kind", "the golden is not a [[checks]] entry: set it with [golden] and --golden")


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    plan: GoldenPlan = check.options["plan"]
    if plan.mode == "off":
        return [CheckResult(KIND, KIND, "skip", plan.note or "not compared")]
    return golden_checks(plan, {arm: rec.metrics for arm, rec in records.items()}, suite.steps)


def golden_checks(plan: GoldenPlan, metrics: dict[str, pd.DataFrame], steps: int) -> list[CheckResult]:
    """Compares the run with the planned golden on the run's steps; a cross-environment comparison
    says which golden and tier in every detail."""
    golden = plan.golden
    trimmed = Golden(
        golden.suite, golden.env_key, golden.provenance, golden.config, golden.tier,
        {arm: {m: s[s.index <= steps] for m, s in ms.items()} for arm, ms in golden.arms.items()},
    )  # fmt: skip
    results = [
        # Named "golden:<arm>[:<metric>]"; grouped as golden checks in the report, whatever their tier.
        replace(r, kind="golden", arms=[r.name.split(":")[1]])
        for r in compare_to_golden(trimmed, metrics, tier_from_spec(plan.tier))
    ]
    if not plan.cross_env:
        return results
    return [replace(r, detail=f"cross-environment vs {golden.env_key}: {r.detail}") for r in results]


def compare_to_golden(golden: Golden, metrics: dict[str, pd.DataFrame], tier: Tier) -> list[CheckResult]:
    """One check per (arm, metric) in the golden, named "golden:<arm>:<metric>"; an arm either lacks fails."""
    results = []
    for arm, trajectories in golden.arms.items():
        for metric, expected in trajectories.items():
            name = f"golden:{arm}:{metric}"
            if arm not in metrics:
                results.append(
                    CheckResult(name, tier.kind, "fail", f"arm '{arm}' is in the golden but not in this run")
                )
                continue
            results.append(compare_arms(name, metrics[arm], expected.to_frame(metric), metric, tier, arm, "golden"))
    for arm in sorted(metrics.keys() - golden.arms.keys()):
        results.append(
            CheckResult(f"golden:{arm}", tier.kind, "fail", f"no golden for arm '{arm}' in {golden.env_key}")
        )
    return results


register(CheckFamily((KIND,), parse, run, reads=(METRICS,), listed=False))
