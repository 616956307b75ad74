"""harness/change.py: a suite as a change check runs it, the line it opens with, and a failure the
base shares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
from suite_files import suite_from

from harness.change import blame_base, change_line, change_suite
from harness.checks.golden import golden_check
from harness.golden_plan import golden_config, plan_golden
from harness.judge import record_checks  # noqa: F401  (judge imports the check families)
from harness.plan import plan_launches
from harness.records import ArmRecords, RankLine, RunRecords
from harness.results import BASE_FAILS, CheckResult
from harness.revisions import Revision

SUITE = """
name = "pair"
description = "two arms"
ranks = 2
steps = 2
[model]
config = "cpu-tiny"
[arms.eager]
chunking = "eager"
[arms.graph]
chunking = "graph"
[[checks]]
kind = "exact"
arms = ["eager", "graph"]
"""


@pytest.fixture
def suite(tmp_path: Path):
    return suite_from(tmp_path, SUITE)


def _revision(label: str, spec: str, sha: str, dirty: str | None = None) -> Revision:
    return Revision(label, spec, sha, "title", dirty, "harness.reference", "harness/reference", "/nowhere")


def test_every_arm_runs_at_both_revisions_in_launches_of_its_own_revision(suite, tmp_path: Path) -> None:
    plan = plan_golden(suite.name, {}, "cpu-gloo-float32-torch2.13", "off", tmp_path / "golden", {})
    changed = change_suite(suite)
    assert {name: arm.revision for name, arm in changed.arms.items()} == {
        "eager": "head", "graph": "head", "eager@base": "base", "graph@base": "base"
    }  # fmt: skip
    change = [c for c in changed.checks if c.kind == "change"]
    assert [c.arms for c in change] == [("eager@base", "eager"), ("graph@base", "graph")]
    assert all(c.tier == {"kind": "exact"} for c in change)
    groups = plan_launches(changed)
    assert [(g.arms, g.revision) for g in groups] == [
        (("eager", "graph"), "head"),
        (("eager@base", "graph@base"), "base"),
    ]
    # The golden is of the arms the suite was written with: its config and its check leave the base out.
    assert golden_config(changed)["arms"].keys() == {"eager", "graph"} == set(golden_check(plan, changed).arms)


def test_the_opening_line_says_both_revisions_and_how_they_compared(suite) -> None:
    revisions = {
        "base": _revision("base", "main", "d" * 40),
        "head": _revision("head", "the working tree", "a" * 40, "x"),
    }
    passed = [
        CheckResult(
            "eager: head vs base: loss", "change", "pass", "2 steps bitwise identical", arms=["eager@base", "eager"]
        )
    ]
    line = change_line(revisions, passed, change_suite(suite))
    assert line == f"head ({'a' * 7}, +dirty) vs base main ({'d' * 7}): 2 steps bitwise identical on 1 arm"
    failed = [
        dataclasses.replace(passed[0], status="fail", detail="first divergence at step 2", first_divergent_step=2)
    ]
    assert change_line(revisions, failed, change_suite(suite)).endswith(
        "1 of 1 arm differ; eager: head vs base: loss: first divergence at step 2"
    )


def _arm(losses: list[float]) -> ArmRecords:
    metrics = pd.DataFrame({"loss": losses, "grad_norm": [1.0] * len(losses)}, index=range(1, len(losses) + 1))
    return ArmRecords(metrics=metrics, ranks={0: [RankLine(1, 1.0, 1.0, None)]})


def test_a_check_the_base_fails_too_is_the_bases_not_the_changes(suite) -> None:
    changed = change_suite(suite)
    own = changed.checks[0]
    failed = CheckResult("eager vs graph: loss", "exact", "fail", "differs at step 1", arms=["eager", "graph"])
    parted = RunRecords({"eager@base": _arm([1.0, 2.0]), "graph@base": _arm([1.0, 2.5])})
    assert blame_base([failed], [own], changed, parted)[0].label == BASE_FAILS
    agreed = RunRecords({"eager@base": _arm([1.0, 2.0]), "graph@base": _arm([1.0, 2.0])})
    assert blame_base([failed], [own], changed, agreed)[0].label is None  # the change broke it
