"""Two arms' metric curves compared at a tier, and determinism (one arm run twice).

``exact``, ``ulp``, ``close`` and ``band`` compare the listed metrics of two arms step by step at
the tier the table gives (see :mod:`harness.compare`). ``determinism`` runs the same arm twice
and demands bitwise equal metrics and, from an arm that records them, identical token-exchange
events.

When a bit-level comparison (``exact``, ``ulp``, ``determinism``) fails, the failure is localised
from the arms' gradient and parameter digests: the first step and the first parameter, in
backward order, whose gradient differs (see :mod:`harness.digests`), in the detail and in
``extra["first_gradient_divergence"]``.
"""

from __future__ import annotations

import dataclasses

from harness.checks.exchange import same_events
from harness.checks.registry import CheckFamily, register
from harness.compare import Exact, Ulp, compare_arms, tier_from_spec
from harness.digests import first_divergence
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import METRICS, TOKEN_EXCHANGE, SuiteReader

PAIR_KINDS = ("exact", "ulp", "close", "band")
DETERMINISM = "determinism"
DEFAULT_METRICS = ("loss", "grad_norm")
DETERMINISM_METRICS = ("loss", "grad_norm", "tokens")


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else None
    a, b = v.arm_pair(raw, dotted, arms)
    if kind != DETERMINISM:
        metrics = v.metric_list(raw, dotted, DEFAULT_METRICS)
        return CheckSpec(kind, name or f"{a} vs {b}", (a, b), metrics, v.tier(raw, dotted))
    v.table(raw, dotted, ("kind", "name", "arms", "metrics"))
    if arms[a].train != arms[b].train:
        diff = sorted(k for k in arms[a].train if arms[a].train[k] != arms[b].train[k])
        raise v.error(f"{dotted}.arms", f"determinism needs identical arms; {a} and {b} differ in {', '.join(diff)}")
    return CheckSpec(kind, name or f"{a} vs {b}", (a, b), v.metric_list(raw, dotted, DETERMINISM_METRICS))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    a, b = check.arms
    tier = Exact() if check.kind == DETERMINISM else tier_from_spec(check.tier)
    results = [
        dataclasses.replace(
            compare_arms(f"{check.name}: {metric}", records[a].metrics, records[b].metrics, metric, tier, a, b),
            kind=check.kind,
        )
        for metric in check.metrics
    ]
    if isinstance(tier, (Exact, Ulp)) and any(r.status == "fail" for r in results):
        results = localised(results, first_divergence(records[a].digests, records[b].digests, a, b))
    if check.kind == DETERMINISM and suite.arms[a].emits(TOKEN_EXCHANGE):
        events = same_events(f"{check.name}: events", records[a], records[b], a, b)
        results.append(dataclasses.replace(events, kind=check.kind))
    return results


def localised(results: list[CheckResult], where: dict) -> list[CheckResult]:
    """Failed metric comparisons, with where the arms' digests first differ added (resume's too)."""
    return [
        dataclasses.replace(
            r, detail=f"{r.detail}; {where['summary']}", extra={**r.extra, "first_gradient_divergence": where}
        )
        if r.status == "fail"
        else r
        for r in results
    ]


register(CheckFamily((*PAIR_KINDS, DETERMINISM), parse, run, reads=(METRICS,)))
