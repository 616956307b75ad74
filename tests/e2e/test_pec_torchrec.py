"""The reference's PEC table against torchrec's own (suite pec-torchrec) through the real CLI on 2 gloo
processes: every row within 1e-6 after every batch with torchrec beside it moving no bit of the
reference; each table bug the reference's own arms share fails pec-oracle naming the batch and the
row; torchrec's backward made to start the OL all-to-all (PR #4498 reverted) fails pec-invariants
on torchrec's own events; and a suite that needs torchrec is refused without it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from suite_files import refused_without

from harness.checks.pec import INVARIANTS
from harness.records import read_jsonl

ORACLE_ARMS = ("adagrad", "sgd")
# torchrec 1.9.2 before #4498 in effect: its backward fires the OL all-to-all itself.
REVERT_4498 = """\
import torchrec.distributed.pec_comm_ops as ops

backward = ops.PECAll2AllSeqWait.backward


def reverted(ctx, grad):
    result = backward(ctx, grad)
    ctx.autograd_ctx.ol_grad_apply.dist()
    return result


ops.PECAll2AllSeqWait.backward = staticmethod(reverted)
"""


def _statuses(run, out: Path) -> dict[str, str]:
    return {c["name"]: c["status"] for c in run.summary(out)["checks"] if c["name"] != "golden"}


def _failing(run, out: Path) -> set[str]:
    return {name for name, status in _statuses(run, out).items() if status == "fail"}


def test_pec_torchrec_passes_on_2_gloo_ranks_every_row_within_1e6_and_moves_no_reference_bit(
    run_harness, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "pec-torchrec", "--ranks", 2, "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    statuses = _statuses(run, out)
    assert set(statuses.values()) == {"pass"}, statuses
    for arm in ORACLE_ARMS:
        assert {f"{arm}: pec-oracle", *(f"{arm}: {name}" for name in INVARIANTS)} <= statuses.keys()
        lines = read_jsonl(out / "arms" / arm / "fidelity.jsonl")
        assert [line["step"] for line in lines] == [1, 2, 3, 4]
        assert all(0 < line["tables"]["model.embed_tokens"]["max_rel_err"] <= 1e-6 for line in lines), lines
        # torchrec's starts and applies are judged beside the reference's
        assert "torchrec:model.embed_tokens" in run.check(out, f"{arm}: pec:one-ol-one-nol")["detail"]
    assert {"adagrad-alone vs adagrad: loss", "adagrad-alone vs adagrad, final weights"} <= statuses.keys()


@pytest.mark.parametrize(
    "fault,batch,arms",
    [
        # the accumulator differs from the second update of a row on: batch 2
        ("adagrad-overwrite", 2, {"adagrad"}),
        # a row sent by both ranks loses one rank's gradient at its first update, under either optimizer
        ("sum-one-source", 1, {"adagrad", "sgd"}),
    ],
)
def test_a_table_bug_the_reference_arms_share_fails_pec_oracle_naming_the_batch_and_row(
    run_harness, tmp_path: Path, fault: str, batch: int, arms: set[str]
) -> None:
    out = tmp_path / fault
    run = run_harness(
        "run", "pec-torchrec", "--ranks", 2, "--golden", "off", "--set", f"pec_fault={fault}", "--out", out
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert _failing(run, out) == {f"{arm}: pec-oracle" for arm in arms}
    for arm in arms:
        check = run.check(out, f"{arm}: pec-oracle")
        assert check["first_divergent_step"] == batch
        assert re.fullmatch(
            rf"batch {batch}: model\.embed_tokens row \d+ rel err \S+ > 1e-06 \(abs diff \S+, worst of 256 rows\)",
            check["detail"],
        ), check["detail"]


def test_torchrec_backward_starting_the_ol_all_to_all_fails_the_autograd_invariant_on_its_events(
    run_harness, plant, tmp_path: Path
) -> None:
    out = tmp_path / "reverted"
    run = run_harness("run", "pec-torchrec", "--ranks", 2, "--golden", "off", "--out", out, env=plant(REVERT_4498))
    assert run.returncode == 1, run.stdout + run.stderr
    assert _failing(run, out) == {
        f"{arm}: {name}" for arm in ORACLE_ARMS for name in ("pec:no-autograd-start", "pec:ol-window")
    }
    assert run.check(out, "adagrad: pec:no-autograd-start")["detail"].startswith(
        "logical rank 0: OL start torchrec:model.embed_tokens of batch 1 (call 1) started inside autograd"
    )


def test_without_torchrec_the_suite_is_refused_with_the_install_line(harness_main, tmp_path: Path) -> None:
    assert refused_without(harness_main, tmp_path, "torchrec", "pec-torchrec") == (
        "error: suites/pec-torchrec.toml: arms.adagrad.oracle: needs torchrec, which is not installed:"
        " tools/install-torchrec\n"
    )


@pytest.mark.parametrize(
    "options,message",
    [
        (
            ("--ranks", 1, "--set", "ep=2"),
            "arms.adagrad.oracle: torchrec's PEC runs one logical rank per process: needs ep (2) equal to the"
            " arm's process count (1; ranks)",
        ),
        (
            ("--set", "pec=sequential"),
            'arms.adagrad.oracle: needs pec = "pipelined", the order of torchrec\'s TrainPipelinePEC,'
            " got 'sequential'",
        ),
    ],
)
def test_an_arm_torchrec_cannot_mirror_is_refused_naming_the_field(
    harness_main, tmp_path: Path, options: tuple, message: str
) -> None:
    out = tmp_path / "run"
    run = harness_main("run", "pec-torchrec", *options, "--out", out)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == f"error: suites/pec-torchrec.toml: {message}\n"
    assert not out.exists()
