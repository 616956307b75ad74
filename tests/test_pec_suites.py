"""The PEC suites through the real CLI on 2-rank gloo runs: pipelined equals sequential bit for bit,
EP=2 in one process equals EP=2 on two, each planted fault of the reference fails the invariant that
names it (exit 1), and the pre-#4498 order fails the autograd invariant."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.checks.pec import INVARIANTS
from harness.records import read_jsonl


def _statuses(run, out: Path) -> dict[str, str]:
    return {c["name"]: c["status"] for c in run.summary(out)["checks"]}


def _curves(out: Path, arm: str) -> list[tuple]:
    """(step, loss, grad_norm) as recorded: floats read back bit for bit."""
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(out / "arms" / arm / "metrics.jsonl")]


def test_pec_passes_over_20_steps_and_ep2_in_one_process_gives_the_same_bits(run_harness, tmp_path: Path) -> None:
    two = tmp_path / "two"
    run = run_harness("run", "pec", "--ranks", 2, "--golden", "off", "--out", two, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, two)
    assert set(statuses.values()) == {"pass"}, statuses
    for arm in ("sequential", "pipelined", "chunked"):
        assert {f"{arm}: {name}" for name in INVARIANTS} <= statuses.keys()
    assert statuses["sequential vs pipelined: loss"] == statuses["sequential vs chunked: grad_norm"] == "pass"
    assert len(_curves(two, "pipelined")) == 20

    one = tmp_path / "one"
    run = run_harness("run", "pec", "--ranks", 1, "--set", "ep=2", "--golden", "off", "--out", one, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for arm in ("sequential", "pipelined", "chunked"):
        assert _curves(one, arm) == _curves(two, arm), arm
    assert sorted(p.name for p in (one / "arms" / "pipelined").glob("pec.rank*.jsonl")) == [
        "pec.rank0.jsonl",
        "pec.rank1.jsonl",
    ]


@pytest.mark.parametrize(
    "fault,caught_by",
    [
        # NOL applied two batches late: the hand-off, stale rows, and the numbers part
        ("nol-two-late", {"pec:nol-handoff", "pec:fresh-lookups", "pec:starts-per-call"}),
        ("ol-before-backward", {"pec:ol-window"}),
        ("no-drain", {"pec:one-ol-one-nol", "pec:starts-per-call"}),
        ("ol-as-nol", {"pec:fresh-lookups"}),
    ],
)
def test_each_planted_pec_fault_exits_1_naming_its_invariant(
    run_harness, tmp_path: Path, fault: str, caught_by: set[str]
) -> None:
    out = tmp_path / fault
    args = ("--steps", 5, "--golden", "off", "--set", f"arms.pipelined.pec_fault={fault}", "--out", out)
    run = run_harness("run", "pec", "--ranks", 2, *args)
    assert run.returncode == 1, run.stdout + run.stderr
    statuses = _statuses(run, out)
    assert {name for name in caught_by if statuses[f"pipelined: {name}"] == "fail"} == caught_by, statuses
    assert all(statuses[f"chunked: {name}"] == "pass" for name in INVARIANTS)  # the fault is in one arm only
    assert f"pipelined: {sorted(caught_by)[0]}" in run.stdout


def test_a_wrong_hand_off_makes_pipelined_and_sequential_differ(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "late"
    args = ("--golden", "off", "--set", "arms.pipelined.pec_fault=nol-two-late", "--out", out)
    run = run_harness("run", "pec", "--ranks", 2, "--steps", 8, *args)
    assert run.returncode == 1, run.stdout + run.stderr
    exact = run.check(out, "sequential vs pipelined: loss")
    assert exact["status"] == "fail" and exact["first_divergent_step"] is not None, exact
    assert run.check(out, "sequential vs chunked: loss")["status"] == "pass"


def test_legacy_order_fails_the_autograd_invariant(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "legacy"
    run = run_harness("run", "pec-legacy", "--ranks", 2, "--steps", 5, "--golden", "off", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr
    autograd = run.check(out, "legacy: pec:no-autograd-start")
    assert autograd["status"] == "fail" and "started inside autograd" in autograd["detail"], autograd
    assert run.check(out, "pipelined: pec:no-autograd-start")["status"] == "pass"
    assert "legacy: pec:no-autograd-start" in run.stdout
    assert "legacy: pec:no-autograd-start" in (out / "junit.xml").read_text()


def test_both_rowwise_optimizers_pipelined_equal_sequential(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "optimizers"
    run = run_harness("run", "pec-optimizers", "--ranks", 2, "--steps", 5, "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, out)
    assert set(statuses.values()) == {"pass"}, statuses
    assert _curves(out, "sgd-pipelined") != _curves(out, "adagrad-pipelined")  # the optimizer is really chosen
