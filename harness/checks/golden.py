"""``golden``: the run's metrics against the golden trajectory recorded for its environment.

Every suite has this check, and no suite lists it: ``[golden]`` and ``--golden`` configure it
(:mod:`harness.golden` plans it before the run), and the run plans it (:func:`golden_check`),
except when ``--golden update`` records a new golden instead. With ``--golden off``, or no golden
that applies, it is one ``skip`` saying why: "skip" never passes silently.

**Drift or regression.** A check that fails its own golden's tier (exact, for every shipped suite)
is judged again on the same records at the suite's cross-environment tier, and the golden's
recorded environment is compared with this run's (golden.fingerprint_changes). It is labelled
``drift`` when the cross-environment tier passes and the environment changed (``torch 2.13.0 ->
2.13.1``): the toolchain moved the numbers, and the golden wants re-recording (:func:`drift_line`
names the command). Otherwise it is a ``regression``: the loose tier fails too, or the environment
is the golden's, so the code moved them. A field the golden predates is unknown, named, and no
change. A check against another environment's golden is already at the cross-environment tier:
its failure is a regression.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pandas as pd

from harness.checks.registry import CheckFamily, register
from harness.compare import Tier, compare_arms, tier_from_spec
from harness.golden import Golden, fingerprint_changes
from harness.golden_plan import GoldenPlan
from harness.records import RunRecords
from harness.results import DRIFT, REGRESSION, CheckResult
from harness.revisions import BASE
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import METRICS, SuiteReader

KIND = "golden"


def golden_check(plan: GoldenPlan, suite: SuiteSpec) -> CheckSpec | None:
    """The golden check of a run with ``plan`` (None when it updates the golden instead), of the arms
    the suite was written with (not a change check's base arms, harness/change.py)."""
    if plan.mode == "update":
        return None
    arms = tuple(arm for arm, spec in suite.arms.items() if spec.revision != BASE)
    return CheckSpec(KIND, KIND, arms, options={"plan": plan})


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    raise v.error(f"{dotted}.kind", "the golden is not a [[checks]] entry: set it with [golden] and --golden")


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    plan: GoldenPlan = check.options["plan"]
    if plan.mode == "off":
        return [CheckResult(KIND, KIND, "skip", plan.note or "not compared")]
    metrics = {arm: rec.metrics for arm, rec in records.items() if arm in check.arms}
    return golden_checks(plan, metrics, suite.steps, suite.golden_cross_env)


def golden_checks(
    plan: GoldenPlan, metrics: dict[str, pd.DataFrame], steps: int, cross_env_tier: dict | None = None
) -> list[CheckResult]:
    """Compares the run with the planned golden on the run's steps; a cross-environment comparison
    says which golden and tier in every detail. A check that fails its own golden is judged again at
    the cross-environment tier, calibrated per metric where the golden carries a calibration, else
    ``cross_env_tier``, and labelled drift or regression (:func:`label_failure`)."""
    golden = plan.golden
    trimmed = Golden(
        golden.suite, golden.env_key, golden.provenance, golden.config, golden.tier,
        {arm: {m: s[s.index <= steps] for m, s in ms.items()} for arm, ms in golden.arms.items()},
    )  # fmt: skip

    def compare(tier: dict, per_metric: dict[str, dict] | None = None) -> list[CheckResult]:
        # Named "golden:<arm>[:<metric>]"; grouped as golden checks in the report, whatever their tier.
        tiers = {m: tier_from_spec(t) for m, t in (per_metric or {}).items()}
        results = compare_to_golden(trimmed, metrics, tier_from_spec(tier), tiers)
        return [replace(r, kind="golden", arms=[r.name.split(":")[1]]) for r in results]

    fixed = cross_env_tier or plan.tier
    if plan.cross_env:
        results = compare(fixed, golden.cross_env_tiers(fixed))
        return [replace(r, detail=f"cross-environment vs {golden.env_key}: {r.detail}") for r in results]
    results = compare(plan.tier)
    if cross_env_tier is None or all(r.status != "fail" for r in results):
        return results
    changed, unrecorded = fingerprint_changes(golden.provenance, plan.fingerprint or {})
    return [
        label_failure(own, loose, changed, unrecorded) if own.status == "fail" else own
        for own, loose in zip(results, compare(cross_env_tier, golden.cross_env_tiers(cross_env_tier)))
    ]


def label_failure(own: CheckResult, loose: CheckResult, changed: list[str], unrecorded: list[str]) -> CheckResult:
    """A check that failed its golden's own tier, labelled by ``loose``, the same check at the
    cross-environment tier, and the environment's ``changed`` and ``unrecorded`` fields
    (golden.fingerprint_changes): drift when the loose tier passes and a field changed, else a
    regression. The detail says why; ``extra`` keeps the loose judgement and the fields."""
    if loose.status != "pass":
        label, why = REGRESSION, f"fails the cross-environment tier too: {loose.detail}"
    elif changed:
        label, why = DRIFT, f"{', '.join(changed)}; passes the cross-environment tier: {loose.detail}"
    else:
        unknown = f" (the golden does not record: {', '.join(unrecorded)})" if unrecorded else ""
        label, why = (
            REGRESSION,
            f"the environment is the golden's{unknown}: the code moved it, within the cross-environment tier",
        )
    extra = {
        **own.extra,
        "cross_env": {"status": loose.status, "detail": loose.detail},
        "environment": {"changed": changed, "unrecorded": unrecorded},
    }
    return replace(own, detail=f"{own.detail}; {why}", label=label, extra=extra)


def drift_line(checks: list[CheckResult], rebless: str) -> str:
    """The console's last line of a run that failed by drift alone: what changed, and ``rebless``,
    the command that re-records the golden and prints its diff for review (golden.rebless_command)."""
    drifted = [c for c in checks if c.label == DRIFT]
    changed = ", ".join(drifted[0].extra["environment"]["changed"])
    moved = f"{changed} moved {len(drifted)} golden check{'s' if len(drifted) != 1 else ''}"
    return f"drift: re-bless: {moved}, within the cross-environment tier; review the new golden: {rebless}"


def compare_to_golden(
    golden: Golden, metrics: dict[str, pd.DataFrame], tier: Tier, per_metric: Mapping[str, Tier] | None = None
) -> list[CheckResult]:
    """One check per (arm, metric) in the golden, named "golden:<arm>:<metric>", at ``tier`` or the
    metric's own in ``per_metric`` (a calibrated cross-environment tier); an arm either lacks fails."""
    per_metric = per_metric or {}
    results = []
    for arm, trajectories in golden.arms.items():
        for metric, expected in trajectories.items():
            name = f"golden:{arm}:{metric}"
            if arm not in metrics:
                results.append(
                    CheckResult(name, tier.kind, "fail", f"arm '{arm}' is in the golden but not in this run")
                )
                continue
            held = per_metric.get(metric, tier)
            results.append(compare_arms(name, metrics[arm], expected.to_frame(metric), metric, held, arm, "golden"))
    for arm in sorted(metrics.keys() - golden.arms.keys()):
        results.append(
            CheckResult(f"golden:{arm}", tier.kind, "fail", f"no golden for arm '{arm}' in {golden.env_key}")
        )
    return results


register(CheckFamily((KIND,), parse, run, reads=(METRICS,), listed=False))
