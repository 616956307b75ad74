"""Runs a suite's [[checks]] on the records its arms left, complete or not.

Checks run on partial records too: an arm that stopped early then fails every check that needs
its missing steps, and ``exactly-once`` names the batches it lost. Nothing here ever passes on
absent data: no events, no recorded MoE layers or no static graph checks fail the check that
needed them.
"""

from __future__ import annotations

import dataclasses

from harness.compare import CheckResult, Exact, compare_arms, tier_from_spec
from harness.invariants import (
    check_correction_stats,
    check_exactly_once,
    check_planned_exchanges,
    check_same_event_sequence,
    check_staleness_ages,
    delayed_oracle_plan,
    pipeline_plan,
    training_plan,
)
from harness.records import ArmRecords
from harness.suites import GRAPH_KIND, PIPELINE_KINDS, ArmSpec, CheckSpec, SuiteSpec


def run_check(check: CheckSpec, suite: SuiteSpec, records: dict[str, ArmRecords]) -> list[CheckResult]:
    """The results of one [[checks]] entry; an arm whose records cannot be read makes it an error."""
    unreadable = [records[arm].error for arm in check.arms if records[arm].error]
    if unreadable:
        return [CheckResult(check.name, check.kind, "error", f"not run: {'; '.join(unreadable)}")]
    if check.kind == "token-exchange-invariants":
        return [r for arm in check.arms for r in _exchange_results(arm, suite.arms[arm], records[arm])]
    if check.kind in PIPELINE_KINDS:
        return [_pipeline_result(check, suite.arms[arm], records[arm], suite.steps) for arm in check.arms]
    if check.kind == GRAPH_KIND:
        return [result for arm in check.arms for result in _graph_results(arm, records[arm].graph_checks)]
    a, b = check.arms
    if check.kind == "same-event-sequence":
        return [_same_events(check.name, records[a], records[b], a, b)]
    tier = Exact() if check.kind == "determinism" else tier_from_spec(check.tier)
    results = [
        dataclasses.replace(
            compare_arms(f"{check.name}: {metric}", records[a].metrics, records[b].metrics, metric, tier, a, b),
            kind=check.kind,
        )
        for metric in check.metrics
    ]
    if check.kind == "determinism":
        events = _same_events(f"{check.name}: events", records[a], records[b], a, b)
        results.append(dataclasses.replace(events, kind=check.kind))
    return results


def _same_events(name: str, a: ArmRecords, b: ArmRecords, label_a: str, label_b: str) -> CheckResult:
    """check_same_event_sequence on every logical rank; the first rank that differs is reported."""
    results = {
        rank: check_same_event_sequence(
            a.events.get(rank, []), b.events.get(rank, []), label_a=label_a, label_b=label_b
        )
        for rank in sorted(a.events.keys() | b.events.keys())
    }
    bad = next((r for r in results.values() if r.status != "pass"), None)
    if bad is not None:
        rank = next(k for k, v in results.items() if v is bad)
        return dataclasses.replace(bad, name=name, detail=f"logical rank {rank}: {bad.detail}")
    total = sum(len(events) for events in a.events.values())
    return CheckResult(
        name, "same-event-sequence", "pass", f"{total} events identical on all {len(results)} logical ranks"
    )


def _exchange_results(arm: str, spec: ArmSpec, records: ArmRecords) -> list[CheckResult]:
    """The token-exchange invariants of one arm, against the exchanges its training implies."""
    kind = "token-exchange-invariants"
    if not records.moe_layers:
        what = "records no MoE layers" if records.moe_layers == [] else "has no arm.json with its MoE layers"
        return [CheckResult(f"{arm}: token-exchange", kind, "fail", f"arm '{arm}' {what}: no exchange to check")]
    train = spec.train
    chunks = train["chunks"] if train["chunking"] != "none" else 1
    steps = records.metrics.index.tolist()
    if spec.versioned and train["trainer"] == "delayed-oracle":
        plan = delayed_oracle_plan(len(steps), train["delay"], always_correct=train["correction"] == "always")
    elif spec.versioned:
        replay, always = train["retention"] == "replay", train["correction"] == "always"
        plan = pipeline_plan(len(steps), train["delay"], replay=replay, always_correct=always)
    else:
        plan = training_plan(steps)
    results = check_planned_exchanges(records.events, plan=plan, moe_layers=records.moe_layers, chunks=chunks)
    return [dataclasses.replace(r, name=f"{arm}: {r.name}") for r in results]


def _pipeline_result(check: CheckSpec, spec: ArmSpec, records: ArmRecords, steps: int) -> CheckResult:
    """One version-protocol check on a versioned arm's update records.

    Batches are numbered like steps (see worker.updates): a run of N steps applies batches 1..N.
    """
    train = spec.train
    if check.kind == "exactly-once":
        result = check_exactly_once(records.updates, range(1, steps + 1))
    elif check.kind == "staleness-ages":
        result = check_staleness_ages(records.updates, train["delay"])
    else:
        result = check_correction_stats(records.updates, train["correction"], train["delay"], train["correction_clip"])
    return dataclasses.replace(result, name=f"{spec.name}: {check.name}")


def _graph_results(arm: str, graph_checks: list[dict]) -> list[CheckResult]:
    """The static checks the rank recorded for a traced arm's graph; none recorded is a failure."""
    if not graph_checks:
        return [CheckResult(f"{arm}: {GRAPH_KIND}", GRAPH_KIND, "fail", "the arm recorded no static graph checks")]
    return [
        CheckResult(f"{arm}: {c['name']}", GRAPH_KIND, c["status"], c["detail"], extra={"problems": c["problems"]})
        for c in graph_checks
    ]
