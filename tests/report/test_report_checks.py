"""Checks in the reports: the arms each concerns, grouped by kind, problems first, inconclusive gates
never read as passes; and metrics that never change left out of the plots."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
from suite_files import suite_from

from harness.checks import run_check
from harness.records import ArmRecords
from harness.report import format_verdict_table, write_html, write_junit
from harness.results import CheckResult

SUITE = """
name = "mini"
description = "three arms, one a prefix of another"
ranks = 2
steps = 3
[arms.eager]
chunking = "eager"
chunks = 2
[arms.eager-traced]
chunking = "eager-traced"
chunks = 2
[arms.graph]
chunking = "graph"
chunks = 2
[[checks]]
kind = "token-exchange-invariants"
[[checks]]
kind = "exact"
arms = ["eager", "graph"]
metrics = ["loss"]
"""


def test_each_result_names_the_arms_it_concerns(tmp_path: Path) -> None:
    """A per-arm result stamped with every arm of its check would file "eager: ..." under graph too."""
    suite = suite_from(tmp_path, SUITE)
    loss = pd.DataFrame({"loss": [2.0, 1.5, 1.25]}, index=pd.Index([1, 2, 3], name="step"))
    records = {arm: ArmRecords(metrics=loss, events={0: [], 1: []}) for arm in suite.arms}
    exchange = run_check(suite.checks[0], suite, records)
    assert [(r.name.split(":")[0], r.arms) for r in exchange] == [
        ("eager", ["eager"]),
        ("eager-traced", ["eager-traced"]),
        ("graph", ["graph"]),
    ]
    [pair] = run_check(suite.checks[1], suite, records)
    assert pair.status == "pass" and pair.to_dict()["arms"] == ["eager", "graph"]
    records["graph"] = ArmRecords(error="unreadable records of arm 'graph': bad line")
    [unread] = run_check(suite.checks[1], suite, records)
    assert unread.status == "error" and unread.arms == ["eager", "graph"]


def test_a_check_made_outside_a_family_has_no_arms_until_given() -> None:
    assert CheckResult("golden", "golden", "skip", "not compared").to_dict()["arms"] == []


def _check(name: str, kind: str, status: str, arms: list[str], **extra: object) -> dict:
    return {"name": name, "kind": kind, "status": status, "detail": f"{name} is {status}", "arms": arms, **extra}


def _summary(checks: list[dict], verdict: str = "fail", exit_code: int = 1) -> dict:
    return {"suite": "mini", "verdict": verdict, "exit_code": exit_code, "ranks": 2, "steps": 3,
            "arms": {"eager": {}, "graph": {}}, "duration_s": 1.0, "checks": checks}  # fmt: skip


ALL_STATUSES = [
    _check("a", "exact", "pass", ["eager", "graph"]),
    _check("b", "throughput", "inconclusive", ["eager", "graph"]),
    _check("c", "exact", "skip", ["eager"]),
    _check("d", "overlap", "fail", ["graph"]),
    _check("e", "ranks-agree", "error", ["eager"]),
]


def test_console_table_puts_inconclusive_after_failures_and_counts_it() -> None:
    lines = format_verdict_table(_summary(ALL_STATUSES)).splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == ["ERROR", "FAIL", "INCONCLUSIVE", "PASS", "SKIP"]
    assert lines[-1] == "1 passed, 1 failed, 1 inconclusive, 1 errors, 1 skipped"


def test_junit_never_reports_an_inconclusive_gate_as_a_pass(tmp_path: Path) -> None:
    write_junit(tmp_path / "junit.xml", _summary(ALL_STATUSES))
    testsuite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert (testsuite.get("tests"), testsuite.get("skipped")) == ("5", "2")
    cases = {case.get("name"): case for case in testsuite.findall("testcase")}
    gate = cases["b"].find("skipped")
    assert gate is not None and gate.get("message") == "inconclusive: b is inconclusive"
    assert list(cases["a"]) == []  # a pass is a bare testcase; the gate is not


def test_checks_are_grouped_by_kind_with_problems_open_and_first(tmp_path: Path) -> None:
    """27 flat rows hid the one failure of a parity run; a group per kind shows where it is."""
    checks = [_check(f"{arm}: token-exchange:{name}", "token-exchange-invariants", "pass", [arm])
              for arm in ("eager", "graph") for name in ("pairing", "reuse")]  # fmt: skip
    checks += [
        _check("eager vs graph: loss", "exact", "pass", ["eager", "graph"]),
        _check("eager: overlap", "overlap", "pass", ["eager"]),
        _check(
            "graph: overlap", "overlap", "fail", ["graph"], first_divergent_step=2, values={"graph": 0.25, "eager": 1.0}
        ),  # fmt: skip
        _check("throughput: graph vs eager", "throughput", "inconclusive", ["eager", "graph"]),
    ]
    write_html(tmp_path / "report.html", _summary(checks), {})
    html = (tmp_path / "report.html").read_text()
    groups = re.findall(r'<details class="group"( open)?>\s*<summary>(.*?)</summary>(.*?)</details>', html, re.S)
    kinds = [re.search(r'class="kind">([^<]+)', summary).group(1) for _, summary, _ in groups]
    assert kinds == ["overlap", "throughput", "token-exchange-invariants", "exact"]
    assert [bool(opened) for opened, _, _ in groups] == [True, True, False, False]
    overlap_summary, overlap_rows = groups[0][1], groups[0][2]
    assert "2 checks: 1 fail, 1 pass" in overlap_summary and "arms: graph, eager" in overlap_summary
    assert overlap_rows.index("graph: overlap") < overlap_rows.index("eager: overlap")  # the failure first
    assert "<li>graph = 0.25</li>" in overlap_rows and "<li>eager = 1.0</li>" in overlap_rows
    assert "4 checks: 4 pass" in groups[2][1] and "arms: eager, graph" in groups[2][1]
    assert all(c["name"] in html and c["detail"] in html for c in checks)
    assert "6 passed, 1 failed, 1 inconclusive, 0 errors, 0 skipped" in html


def _metrics(golden_loss_offset: float = 0.0) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    steps = pd.RangeIndex(1, 6, name="step")
    loss = 2.0 * np.exp(-np.arange(5) / 4)
    arms = {
        arm: pd.DataFrame({"loss": loss + shift, "tokens": 256, "step_time_s": 0.01 + shift, "lr": 0.001}, index=steps)
        for arm, shift in (("eager", 0.0), ("graph", 1e-6))
    }
    golden = {"eager": pd.DataFrame({"lr": 0.001 + golden_loss_offset, "loss": loss}, index=steps)}
    return arms, golden


def test_metrics_constant_in_every_arm_are_listed_not_plotted(tmp_path: Path) -> None:
    metrics, golden = _metrics()
    write_html(tmp_path / "report.html", _summary([]), metrics, golden=golden)
    html = (tmp_path / "report.html").read_text()
    plotted = re.findall(r'<img alt="([^:"]+): all arms', html)
    assert plotted == ["loss", "step_time_s"]
    assert "constant in every arm: lr = 0.001, tokens = 256" in html
    assert html.count('<td class="num">256</td>') == 2 * 5  # still in the per-step table, both arms


def test_a_metric_whose_golden_differs_is_not_constant(tmp_path: Path) -> None:
    metrics, golden = _metrics(golden_loss_offset=1e-4)
    write_html(tmp_path / "report.html", _summary([]), metrics, golden=golden)
    html = (tmp_path / "report.html").read_text()
    assert re.findall(r'<img alt="([^:"]+): all arms', html) == ["loss", "lr", "step_time_s"]
    assert "constant in every arm: tokens = 256" in html
