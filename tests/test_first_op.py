"""The first op where two arms part, located by ``harness run`` in real rank processes
(harness/first_op.py): the run's exact check fails on a bug planted in one arm, and its
summary.json, report and console must name the op the bug is in, without touching the verdict.

The runs are cpu-tiny on 2 gloo processes for 1 step, two eager arms (the in-process tests of
harness/op_divergence/ cover traced arms, tests/op_divergence/test_op_divergence.py).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import MANIFEST_SCHEMA

from harness.first_op import locate_first_op
from harness.judge import judge
from harness.kinds import run_kind
from harness.launchers import LaunchContext, LaunchResult
from harness.launching import Launched
from harness.op_divergence import OpRecord
from harness.op_divergence.files import read_captured, read_ops, write_captured, write_ops
from harness.phases import read_rank_phases
from harness.plan import LaunchGroup
from harness.prepare import RunOptions, read_prepared
from harness.records import RecordError
from harness.suites import load_suite

FACTOR = 2.5
# Two arms that differ in one planted bug: the planted arm's router scales its weights twice
# (cpu-tiny's factor is 1, where twice is once).
SUITE = f"""
name = "first-op"
description = "one arm with its routed scaling applied twice"
ranks = 2
steps = 1

[model]
config = "cpu-tiny"
routed_scaling_factor = {FACTOR}

[train]
seed = 42

[arms.base]

[arms.planted]
fault = "routed-scaling-twice"

[[checks]]
kind = "exact"
arms = ["base", "planted"]
metrics = ["loss", "grad_norm"]
"""


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    path = tmp_path / "first-op.toml"
    path.write_text(SUITE)
    return path


def test_a_failed_exact_check_names_the_first_op_where_its_arms_part(run_harness: Callable, suite: Path, tmp_path):
    out = tmp_path / "run"
    run = run_harness("run", suite, "--out", out, env={"HARNESS_FIRST_OP": "auto"})  # auto: the default
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.summary(out)
    assert summary["verdict"] == "fail" and summary["label"] == "regression"
    check = run.check(out, "base vs planted: loss")
    assert check["status"] == "fail" and check["first_divergent_step"] == 1
    found = check["extra"]["first_op_divergence"]
    assert (found["status"], found["steps"], found["rank"], found["reran_as_run"]) == ("located", 1, 0, True)
    assert found["first_op"]["kind"] == "outputs differ" and found["only_in_a"] == found["only_in_b"] == []
    first = found["first_difference"]
    for side in (first["a"], first["b"]):
        assert (side["op"], side["module"], side["backward"], side["step"]) == (
            "aten.mul.Tensor",
            "model.layers.1.mlp.gate",
            False,
            1,
        )
    # Measured in the capture pass: the planted arm's weights are the base's times the factor once more.
    [output] = first["outputs"]
    assert first["reproduced"] and output["max_rel"] == pytest.approx((FACTOR - 1) / FACTOR, rel=1e-6)
    assert output["max_abs"] == pytest.approx(first["a"]["absmax"][0] * (FACTOR - 1), rel=1e-6)
    assert [r["rank"] for r in found["ranks"]] == [0, 1]
    [row] = [r for r in found["window"] if r.get("first")]
    assert row["a"]["index"] == first["a"]["index"] and row["b"]["index"] == first["b"]["index"]

    line = next(line for line in run.stdout.splitlines() if line.startswith("first op: base and planted part"))
    assert line == found["line"]
    assert "rank 0, step 1, forward aten.mul.Tensor in model.layers.1.mlp.gate -> f32[" in line
    assert f"max rel diff {(FACTOR - 1) / FACTOR:.3g}" in line
    report = (out / "report.html").read_text()
    assert "First op where base and planted part" in report and "model.layers.1.mlp.gate" in report
    # Each rank of each arm recorded its own ops, in a run directory of the re-run's own.
    for arm in ("base", "planted"):
        assert len(read_ops(out / "first-op" / "record" / "arms" / arm / "ops.rank1.jsonl").records) > 100
    for rerun in ("record", "capture"):
        MANIFEST_SCHEMA.validate(json.loads((out / "first-op" / rerun / "manifest.json").read_text()))
    # The other check failed too; one op is located per run, on the check whose arms part first.
    assert "first_op_divergence" not in run.check(out, "base vs planted: grad_norm")["extra"]

    # Judged again with a budget the run's own phase times say the re-run cannot fit: auto skips it.
    prepared = read_prepared(out, load_suite(str(suite)), RunOptions(first_op="auto", first_op_budget_s=1.0))
    records = run_kind(prepared.suite).read(out)
    launched = Launched(rank_phases={group.name: read_rank_phases(out, group.name) for group in prepared.groups})
    console = io.StringIO()
    judged = locate_first_op(prepared, launched, records, judge(prepared, launched, records), no_launch, console)
    skipped = next(c for c in judged.checks if c.name == "base vs planted: loss").extra["first_op_divergence"]
    assert skipped["status"] == "skipped" and judged.exit_code == 1
    assert skipped["line"].startswith("first op: not located: re-running steps 1-1 op by op should take about")
    assert skipped["line"].endswith("over the budget of 1 s (--first-op-budget; --first-op on runs it regardless)")
    assert console.getvalue() == skipped["line"] + "\n"


def no_launch(group: LaunchGroup, context: LaunchContext) -> LaunchResult:
    raise AssertionError(f"launched {group.name} though the re-run was over its budget")


def test_arms_with_logical_ranks_in_one_process_are_refused_in_one_line(run_harness: Callable, suite: Path, tmp_path):
    out = tmp_path / "run"
    one_process = ("--set", "arms.base.ranks=1", "--set", "arms.planted.ranks=1")  # each: EP 2 in 1 process
    run = run_harness("run", suite, *one_process, "--first-op", "on", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr  # the run's own verdict, untouched
    found = run.check(out, "base vs planted: loss")["extra"]["first_op_divergence"]
    assert found["status"] == "refused"
    assert found["line"] == (
        "first op: not located: arm 'base' runs 2 logical ranks in 1 process(es); recording ops needs one"
        " logical rank per process (a thread-local recorder cannot see their pool threads)"
    )
    assert found["line"] in run.stdout.splitlines()
    assert not (out / "first-op").exists()  # refused before launching


def test_op_files_read_back_typed_and_refuse_what_is_not_theirs(tmp_path: Path) -> None:
    record = OpRecord(0, 1, "aten.mul.Tensor", "m", False, ("f32[2]",), ("ab",), (float("inf"),), (), True)
    write_ops(tmp_path / "ops.jsonl", "a", 0, 1, [record])
    assert read_ops(tmp_path / "ops.jsonl").records == [record]
    lines = (tmp_path / "ops.jsonl").read_text().splitlines()
    (tmp_path / "short.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(RecordError, match="expected 1 ops, found 0"):
        read_ops(tmp_path / "short.jsonl")

    outputs = [torch.randn(3, 2).bfloat16(), torch.arange(4)]
    write_captured(tmp_path / "kept.npz", outputs)
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(read_captured(tmp_path / "kept.npz"), outputs))
    header = json.loads(lines[0])
    assert header == {"arm": "a", "rank": 0, "steps": 1, "ops": 1, "refused": None}
