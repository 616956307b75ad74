"""Throughput runs: the ABBA plan, the gate's verdicts and exit codes, and real measurements."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from harness.checks.throughput import judge_throughput
from harness.kinds import run_kind
from harness.plan import plan_measurements, plan_throughput_launches
from harness.report.throughput import improvement_note
from harness.results import CheckResult
from harness.verdict import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_INFRA, EXIT_PASS, verdict_of
from tests.suite_files import suite_from

SUITE = """
name = "abba-test"
description = "two identical arms: any difference between them is planted or noise"
ranks = 2
steps = 5
[model]
config = "cpu-tiny"
[train]
seed = 42
routing = "forced-balanced"
local_batch = 4
seq_len = 32
[arms.base]
[arms.twin]
{extra}
[throughput]
a = "base"
b = "twin"
blocks = {blocks}
steps = {steps}
warmup = 2
"""


def _suite(tmp_path: Path, blocks: int | str = 4, steps: int = 4, extra: str = "", **throughput: object):
    text = SUITE.format(blocks=json.dumps(blocks), steps=steps, extra=extra)
    text += "".join(f"{key} = {json.dumps(value)}\n" for key, value in throughput.items())
    return suite_from(tmp_path, text)


def test_plan_is_abba_blocks_with_the_control_interleaved(tmp_path: Path) -> None:
    suite = _suite(tmp_path, blocks=2, control=True)
    plan = plan_measurements(suite.throughput)
    assert [(m.series, m.block, m.role) for m in plan[:8]] == [
        ("main", 1, "A"), ("main", 1, "B"), ("main", 1, "B"), ("main", 1, "A"),
        ("control", 1, "A"), ("control", 1, "B"), ("control", 1, "B"), ("control", 1, "A"),
    ]  # fmt: skip
    # The control times A against a second copy of A, never against B.
    assert {(m.copy, m.arm) for m in plan if m.series == "control"} == {("A", "base"), ("A2", "base")}
    assert len(plan) == 16
    (group,) = plan_throughput_launches(suite)
    assert group.measurements == tuple(plan) and group.arms == ("base", "twin")


def test_arms_of_different_process_counts_get_a_launch_per_run_of_one_arms_positions(tmp_path: Path) -> None:
    suite = _suite(tmp_path, blocks=2, extra="[arms.solo]\nranks = 1\n")
    suite = suite_from(tmp_path, (tmp_path / "suite.toml").read_text().replace('b = "twin"', 'b = "solo"'))
    groups = plan_throughput_launches(suite)
    # A | B B | A A | B B | A: every position timed once, in ABBA order, each launch one arm's.
    positions = [[(m.block, m.position) for m in g.measurements] for g in groups]
    assert positions == [[(1, 0)], [(1, 1), (1, 2)], [(1, 3), (2, 0)], [(2, 1), (2, 2)], [(2, 3)]]
    assert [g.ranks for g in groups] == [2, 1, 2, 1, 2] and all(len(g.arms) == 1 for g in groups)
    assert len({g.log_dir for g in groups}) == 5  # each launch keeps its own rank logs


def _rows(ratios: list[float], series: str = "main", jitter: float = 0.0, seed: int = 0) -> list[dict]:
    """Block positions whose B/A step time is ``ratios[k]`` in block k, around 0.1 s."""
    rng = random.Random(seed)
    rows = []
    for block, ratio in enumerate(ratios, start=1):
        for position, role in enumerate("ABBA"):
            step_time = 0.1 * (ratio if role == "B" else 1.0) * (1 + rng.uniform(-jitter, jitter))
            copy = role if series == "main" else {"A": "A", "B": "A2"}[role]
            rows.append(
                {"series": series, "block": block, "position": position, "role": role, "copy": copy, "arm": "x",
                 "steps": 4, "first_step": 1, "seconds": 4 * step_time, "step_time_s": step_time,
                 "tokens_per_s": 256 / step_time, "peak_memory_bytes": 1 << 20, "timing": "wall"}
            )  # fmt: skip
    return rows


def _judge(tmp_path: Path, rows: list[dict], **throughput: object) -> CheckResult:
    suite = _suite(tmp_path, **throughput)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    separate = len(plan_throughput_launches(suite)) > 1  # one launch per block position
    return judge_throughput(suite.throughput, run_kind(suite).read(run_dir), separate)


@pytest.mark.parametrize(
    ("ratios", "status"),
    [
        ([1.00, 1.005, 0.995, 1.00], "pass"),
        ([1.30, 1.31, 1.29, 1.30], "fail"),
        ([1.05, 1.07, 1.03, 1.05], "inconclusive"),  # the interval straddles 1 + 0.05
        ([0.90, 1.20, 0.95, 1.15], "inconclusive"),  # too noisy to say
    ],
)
def test_gate_verdicts(tmp_path: Path, ratios: list[float], status: str) -> None:
    gate = _judge(tmp_path, _rows(ratios))
    measured = gate.extra["throughput"]
    assert gate.status == status, gate.detail
    assert measured["per_block_ratios"] == pytest.approx(ratios)
    assert measured["low"] <= measured["ratio"] <= measured["high"]
    assert gate.arms == ["base", "twin"]


def test_a_tighter_gate_fails_what_a_looser_one_passes(tmp_path: Path) -> None:
    rows = _rows([1.10, 1.11, 1.09, 1.10])
    assert _judge(tmp_path, rows, max_slowdown=0.05).status == "fail"
    assert _judge(tmp_path, rows, max_slowdown=0.2).status == "pass"


def test_big_improvement_is_flagged(tmp_path: Path) -> None:
    gate = _judge(tmp_path, _rows([0.7, 0.71, 0.69, 0.7]))
    assert gate.status == "pass" and gate.extra["throughput"]["improvement"]
    assert "check whether the baseline moved" in improvement_note(gate.extra["throughput"])
    assert not _judge(tmp_path, _rows([0.9, 0.91, 0.89, 0.9])).extra["throughput"]["improvement"]


def test_a_control_beyond_the_threshold_makes_the_verdict_inconclusive(tmp_path: Path) -> None:
    main = _rows([1.00, 1.005, 0.995, 1.00])
    quiet = _judge(tmp_path, main + _rows([1.0, 1.0, 1.0, 1.0], "control"), control=True)
    assert quiet.status == "pass" and quiet.extra["throughput"]["control"]["ratio"] == pytest.approx(1.0)
    shaky = _judge(tmp_path, main + _rows([1.2, 1.21, 1.19, 1.2], "control"), control=True)
    assert shaky.status == "inconclusive" and "A/A control itself lies beyond" in shaky.detail


def test_partial_blocks_are_left_out_and_too_few_are_an_error(tmp_path: Path) -> None:
    rows = _rows([1.0, 1.0, 1.0, 1.0, 1.0])
    partial = _judge(tmp_path, rows[:-1], blocks=5)  # the last block lost its final A
    assert partial.extra["throughput"]["blocks"] == 4 and partial.status == "pass"
    assert partial.extra["throughput"]["stopped"] == "cut short after 4 of 5 blocks"
    too_few = _judge(tmp_path, rows[:7])
    assert too_few.status == "error" and "1 complete ABBA block(s) of 4" in too_few.detail
    assert _judge(tmp_path, []).status == "error"


def test_exit_code_precedence() -> None:
    def result(*statuses: str) -> list[CheckResult]:
        return [CheckResult(s, "x", s, "") for s in statuses]

    assert verdict_of(result("pass", "inconclusive")) == ("inconclusive", EXIT_INCONCLUSIVE)
    assert verdict_of(result("inconclusive", "fail")) == ("fail", EXIT_FAIL)
    assert verdict_of(result("fail", "error", "inconclusive")) == ("error", EXIT_INFRA)
    assert verdict_of(result("pass", "skip")) == ("pass", EXIT_PASS)


def _throughput_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "throughput.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("slow_arm", "exit_code", "verdict"),
    [("twin", EXIT_FAIL, "slower beyond 5% with confidence"), ("base", EXIT_PASS, "not slower beyond 5%")],
    ids=["slow-b-fails", "slow-a-passes"],
)
def test_planted_slowdown_decides_the_gate(
    run_harness, tmp_path: Path, slow_arm: str, exit_code: int, verdict: str
) -> None:
    # Every step of the slowed arm sleeps its own duration again: B/A near 2 when B is slowed, near
    # 0.5 when A is. Blocks run until the interval clears the threshold: a CI machine busy with
    # other tests has read 50% as 1.23 [0.88, 1.72] after 6 blocks, which more blocks then decide.
    path = tmp_path / "suite.toml"
    _suite(tmp_path, blocks="auto", steps=4, max_blocks=60)
    out = tmp_path / "run"
    slowdown = ("--set", f"debug.slow_arm={slow_arm}", "--set", "debug.slow_fraction=1.0")
    run = run_harness("run", path, *slowdown, "--out", out)
    summary = json.loads((out / "summary.json").read_text())
    assert run.returncode == exit_code, run.stdout + run.stderr
    assert summary["exit_code"] == exit_code and verdict in run.stdout
    measured = summary["throughput"]
    blocks = measured["blocks"]
    assert measured["stopped"] == f"the interval cleared the threshold after {blocks} blocks" and blocks < 60
    assert len(_throughput_rows(out)) == 4 * blocks and [i["blocks"] for i in measured["sequence"]] == [
        *range(1, blocks + 1)
    ]
    assert measured["sequence"][-1]["low"] == measured["low"] and measured["sequence"][-1]["high"] == measured["high"]
    # The block before the last had not decided: the run stopped at the first block that did.
    before = measured["sequence"][-2]
    assert before["low"] <= 1.05 < before["high"]
    assert measured["stopped"] in (out / "report.html").read_text()
    if slow_arm == "twin":
        assert measured["low"] > 1.05 and "<failure" in (out / "junit.xml").read_text()
    else:  # B much faster than A: flagged, since that usually means the baseline moved
        assert measured["high"] <= 1.05 and measured["improvement"]  # it stops at the first block that passes
        assert "check whether the baseline moved" in run.stdout
    assert (out / "report.html").is_file()


@pytest.mark.parametrize(
    ("limit", "stopped"),
    [(("--max-blocks", 3), "--max-blocks 3 reached"), (("--budget-s", 0.5), "--budget-s 0.5 spent")],
    ids=["max-blocks", "budget"],
)
def test_auto_blocks_that_run_out_are_inconclusive(run_harness, tmp_path: Path, limit: tuple, stopped: str) -> None:
    # A against a copy of A, with too little to bound the interval (it needs 4 blocks): the run stops
    # at the limit and says so, exit 4 (neither a regression nor a flake).
    _suite(tmp_path, blocks="auto", steps=2)
    out = tmp_path / "run"
    run = run_harness("abba", tmp_path / "suite.toml", "--b", "base", *limit, "--out", out)
    assert run.returncode == EXIT_INCONCLUSIVE, run.stdout + run.stderr
    measured = json.loads((out / "summary.json").read_text())["throughput"]
    assert measured["stopped"].startswith(stopped) and f"stopped: {stopped}" in run.stdout
    assert "rerun with a larger --max-blocks or --budget-s" in measured["headline"]
    blocks = measured["blocks"]
    assert len(_throughput_rows(out)) == 4 * blocks and 2 <= blocks <= 3
    if limit[0] == "--budget-s":
        assert measured["measuring_s"] >= 0.5


def test_auto_blocks_stop_between_launches_of_separate_block_positions(run_harness, tmp_path: Path) -> None:
    # B takes one process, A two: every block position is a launch of its own, and the launcher
    # applies the stop rule between launches (here the budget, spent by the second block).
    _suite(tmp_path, blocks="auto", steps=1, extra="[arms.solo]\nranks = 1\n", budget_s=0.01)
    out = tmp_path / "run"
    run = run_harness("abba", tmp_path / "suite.toml", "--b", "solo", "--warmup", 0, "--out", out)
    assert run.returncode == EXIT_INCONCLUSIVE, run.stdout + run.stderr
    measured = json.loads((out / "summary.json").read_text())["throughput"]
    assert measured["mode"] == "separate-launches" and measured["stopped"].startswith("--budget-s 0.01 spent")
    assert measured["blocks"] == 2 and len(_throughput_rows(out)) == 8


def test_abba_of_an_arm_against_itself_never_fails(run_harness, tmp_path: Path) -> None:
    path = tmp_path / "suite.toml"
    _suite(tmp_path)
    out = tmp_path / "run"
    run = run_harness(
        "abba", path, "--a", "base", "--b", "base", "--blocks", 3, "--steps", 3, "--control", "--out", out
    )
    assert run.returncode in (EXIT_PASS, EXIT_INCONCLUSIVE), run.stdout + run.stderr
    rows = _throughput_rows(out)
    assert len(rows) == 2 * 3 * 4 and {r["series"] for r in rows} == {"main", "control"}
    # Each copy keeps training its own model (A serves both series): its timed steps follow on from
    # one block position to the next, after its 2 warm-up steps.
    for copy, positions in (("A", 12), ("B", 6), ("A2", 6)):
        firsts = [r["first_step"] for r in rows if r["copy"] == copy]
        assert firsts == [3 + 3 * i for i in range(positions)], (copy, firsts)
    assert all(r["seconds"] > 0 and r["peak_memory_bytes"] > 0 and r["timing"] == "wall" for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == run.returncode and summary["throughput"]["control"]["blocks"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("parity",), "suite parity has no [throughput] table; name the arms with --a and --b"),
        (("parity", "--a", "eager", "--b", "graph", "--blocks", 1), '--blocks: expected "auto" or an int >= 2, got 1'),
        (("parity", "--a", "eager", "--b", "nope"), '--b: expected one of eager, eager-traced, graph, got "nope"'),
        (("parity", "--a", "eager", "--b", "graph", "--max-slowdown", -1), "--max-slowdown: expected a number >= 0"),
        (("fidelity", "--a", "q-lora", "--b", "q-lora"), "trains in lockstep with an oracle: not timed"),
        (("parity", "--a", "eager", "--b", "graph", "--blocks", "sometimes"), 'expected "auto" or an int >= 2'),
        (("parity", "--a", "eager", "--b", "graph", "--max-blocks", 1), "--max-blocks: expected int >= 2, got 1"),
        (("parity", "--a", "eager", "--b", "graph", "--budget-s", 0), "--budget-s: expected a number > 0, got 0"),
        (
            ("throughput-pec", "--budget-s", 900),
            "throughput.budget_s 900 is not under --timeout 600: the launch would be stopped before the budget",
        ),
    ],
    ids=[
        "no-arms",
        "one-block",
        "unknown-arm",
        "negative-gate",
        "oracle-arm",
        "blocks-word",
        "max-blocks",
        "budget",
        "budget-over-timeout",
    ],  # fmt: skip
)
def test_bad_abba_usage_exits_2_with_one_line(harness_main, tmp_path: Path, args: tuple, message: str) -> None:
    run = harness_main("abba", *args, "--out", tmp_path / "run")
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_golden_update_of_a_throughput_suite_exits_2(harness_main, tmp_path: Path) -> None:
    run = harness_main("golden", "update", "throughput-pec", "--out", tmp_path / "run")
    assert run.returncode == 2 and "throughput-pec: a throughput run records no golden" in run.stderr
