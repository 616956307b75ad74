"""The check glue on records that are missing or partial: nothing passes on absent data."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from suite_files import suite_from

from harness.checks import run_check
from harness.environment import CpuPin
from harness.judge import record_checks
from harness.records import ArmRecords

SUITE = """
name = "mini"
description = "two arms"
ranks = 2
steps = 3
[arms.eager]
chunking = "eager"
chunks = 2
[arms.graph]
chunking = "graph"
chunks = 2
routing = "forced-balanced"
[[checks]]
kind = "token-exchange-invariants"
[[checks]]
kind = "graph-invariants"
"""


def _suite(tmp_path: Path):
    return suite_from(tmp_path, SUITE)


def test_token_exchange_fails_an_arm_without_recorded_moe_layers(tmp_path: Path) -> None:
    """An arm.json without moe_layers once meant "nothing to check", and passed on empty event logs."""
    suite = _suite(tmp_path)
    records = {arm: ArmRecords(events={0: [], 1: []}) for arm in suite.arms}
    results = run_check(suite.checks[0], suite, records)
    assert [(r.name, r.status) for r in results] == [
        ("eager: token-exchange", "fail"),
        ("graph: token-exchange", "fail"),
    ]
    assert results[0].detail == "arm 'eager' has no arm.json with its MoE layers: no exchange to check"
    records["eager"].facts = suite.arms["eager"].facts
    eager = run_check(suite.checks[0], suite, records)[:4]
    assert {r.status for r in eager} == {"fail"} and "no token-exchange events recorded" in eager[0].detail


def test_unreadable_records_are_an_error_not_a_skip(tmp_path: Path) -> None:
    suite = _suite(tmp_path)
    records = {arm: ArmRecords(error=f"unreadable records of arm '{arm}': bad line") for arm in suite.arms}
    [result] = run_check(suite.checks[0], suite, records)
    assert result.status == "error" and "bad line" in result.detail


def test_an_arm_short_of_steps_fails_and_kernels_off_the_pin_are_an_error(tmp_path: Path) -> None:
    suite = _suite(tmp_path)
    pin = CpuPin("avx2", "avx2", {"ATEN_CPU_CAPABILITY": "avx2"})
    complete = ArmRecords(metrics=pd.DataFrame({"loss": [1.0, 1.0, 1.0]}, index=pd.Index([1, 2, 3], name="step")))
    complete.cpu_capability = "avx2"
    short = ArmRecords(metrics=complete.metrics.head(1), cpu_capability="avx512")
    results = record_checks(suite, {"eager": complete, "graph": short}, pin, crashed=False)
    assert [(r.name, r.status) for r in results] == [("records: graph", "fail"), ("cpu-isa: graph", "error")]
    assert results[0].detail == "arm 'graph' recorded 1 of 3 steps, and no rank failed"
    assert results[1].detail == "arm 'graph' ran on avx512 kernels, not the pinned avx2"
    crashed = record_checks(suite, {"eager": complete, "graph": short}, None, crashed=True)
    assert crashed == []  # the rank failure already says why; the run exits 3, not 1
