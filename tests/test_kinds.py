"""The two kinds of run: what each plans, judges, reads and reports, and when a throughput run of
separate launches may stop early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from suite_files import suite_from

from harness.golden_plan import plan_golden
from harness.kinds import ThroughputRun, TrainingRun, run_kind
from harness.plan import LaunchGroup
from harness.prepare import RunOptions, UsageError, prepare_run
from harness.records import ArmRecords

SUITE = """
name = "kinds"
description = "three arms, two process counts"
ranks = 2
steps = 3
[model]
config = "cpu-tiny"
[train]
seed = 42
[arms.base]
[arms.solo]
ranks = 1
[arms.spare]
[[checks]]
kind = "exact"
arms = ["base", "spare"]
metrics = ["loss"]
"""

THROUGHPUT = """
[throughput]
a = "base"
b = "solo"
blocks = "auto"
max_blocks = 6
steps = 4
warmup = 1
"""


def _block(block: int, ratio: float) -> list[dict]:
    """One whole ABBA block of the main series whose B is ``ratio`` times A's step time."""
    return [
        {
            "series": "main",
            "block": block,
            "position": position,
            "role": role,
            "step_time_s": 0.1 * ratio ** (role == "B"),
        }
        for position, role in enumerate("ABBA")
    ]


def test_a_suite_without_a_throughput_table_is_a_training_run_judged_by_its_checks(tmp_path: Path) -> None:
    suite = suite_from(tmp_path, SUITE)
    kind = run_kind(suite)
    assert isinstance(kind, TrainingRun) and kind.records_golden and kind.steps == 3
    groups = kind.launches()
    assert [g.arms for g in groups] == [("base", "spare"), ("solo",)]
    golden = plan_golden(suite.name, {}, "key", "off", tmp_path / "golden", {})
    assert [c.kind for c in kind.checks(golden, groups)] == ["exact", "golden"]  # the golden's says "not compared"
    updating = plan_golden(suite.name, {}, "key", "update", tmp_path / "golden", {})
    assert kind.checks(updating, groups) == list(suite.checks)  # the run records its golden instead
    assert not any(kind.measured_enough(tmp_path, g) for g in groups)
    # Arms that left records are reported with the steps each completed; one that left none is not.
    records = kind.read(tmp_path / "run")
    records.arms.pop("spare")
    records.arms["base"] = ArmRecords(metrics=records["base"].metrics.iloc[0:0])
    assert kind.reported_arms(records) == {
        "base": {"ranks": 2, "ep": 2, "steps_completed": 0},
        "solo": {"ranks": 1, "ep": 2, "steps_completed": 0},  # both logical ranks in one process
    }


def test_a_throughput_run_is_judged_by_its_gate_alone_and_records_no_golden(tmp_path: Path) -> None:
    suite = suite_from(tmp_path, SUITE + THROUGHPUT)
    kind = run_kind(suite)
    assert isinstance(kind, ThroughputRun) and not kind.records_golden and kind.steps == 4
    groups = kind.launches()
    assert all(len(g.arms) == 1 for g in groups) and len(groups) > 1  # A and B differ in process count
    golden = plan_golden(suite.name, {}, "key", "none", tmp_path / "golden", {})
    assert golden.note is None  # a throughput run says nothing of a golden it cannot have
    assert [c.kind for c in kind.checks(golden, groups)] == ["throughput"]
    assert kind.reported_arms(kind.read(tmp_path)) == {
        "base": {"ranks": 2, "ep": 2},
        "solo": {"ranks": 1, "ep": 2},
    }
    with pytest.raises(UsageError, match="a throughput run records no golden"):
        prepare_run(suite, RunOptions(golden="update", out=tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_separate_launches_stop_after_the_block_that_clears_the_gate_and_not_inside_one(tmp_path: Path) -> None:
    kind = run_kind(suite_from(tmp_path, SUITE + THROUGHPUT))
    groups = kind.launches()

    def launch_of(block: int, position: int) -> LaunchGroup:
        return next(g for g in groups if any((m.block, m.position) == (block, position) for m in g.measurements))

    # A | B B | A A | B B | ...: a block's two B positions share a launch, its last A the next block's first A's.
    assert [len(g.measurements) for g in groups[:4]] == [1, 2, 2, 2] and launch_of(1, 3) == launch_of(2, 0)
    rows = [row for block in range(1, 5) for row in _block(block, 1.0)]
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    assert not kind.measured_enough(tmp_path, launch_of(4, 2))  # block 4 is not whole yet
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert kind.measured_enough(tmp_path, launch_of(4, 3))  # four equal blocks clear a 5% threshold
    (tmp_path / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    assert not kind.measured_enough(tmp_path, launch_of(1, 3))  # one block says nothing yet
