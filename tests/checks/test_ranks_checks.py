"""The ranks-agree rule on hand-made per-rank records: each way a logical rank can disagree."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.checks import ranks as ranks_check
from harness.records import RankLine, RecordError


def _records(steps: int = 5, hash_at: tuple[int, ...] = (5,), **per_step: object) -> list[dict]:
    records = []
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 5.0 - step / 10, "grad_norm": 1.0 + step / 10}
        if step in hash_at:
            record["replicated_hash"] = "aa" * 16
        records.append(record)
    return records


def _judge(name: str, ranks: dict[int, list[dict]]) -> object:
    """The check on the lines as the records hold them, typed as reading them makes them."""
    return ranks_check.check_ranks_agree(name, {r: [RankLine(**line) for line in lines] for r, lines in ranks.items()})


def test_identical_ranks_pass_and_say_which_steps_were_hashed() -> None:
    result = _judge("arm: ranks-agree", {0: _records(), 1: _records(), 2: _records()})
    assert result.status == "pass", result.detail
    assert "5 steps on 3 logical ranks" in result.detail and "steps 5" in result.detail


def test_a_drifted_replica_fails_naming_the_step_the_hash_and_the_rank() -> None:
    drifted = _records()
    drifted[4]["replicated_hash"] = "bb" * 16
    result = _judge("arm: ranks-agree", {0: _records(), 1: drifted, 2: _records()})
    assert result.status == "fail" and result.first_divergent_step == 5
    assert result.detail == (
        f"step 5: replicated_hash differs on logical rank 1 from logical rank 0 (rank 0: '{'aa' * 16}',"
        f" rank 1: '{'bb' * 16}')"
    )


def test_a_loss_one_bit_off_on_one_rank_fails_at_its_step() -> None:
    off = _records()
    off[1]["loss"] = math.nextafter(off[1]["loss"], math.inf)
    result = _judge("arm: ranks-agree", {0: _records(), 1: off})
    assert result.status == "fail" and result.first_divergent_step == 2
    assert "step 2: loss differs on logical rank 1" in result.detail


def test_negative_zero_is_not_zero() -> None:
    a, b = _records(), _records()
    a[0]["grad_norm"], b[0]["grad_norm"] = 0.0, -0.0
    assert _judge("x", {0: a, 1: b}).status == "fail"


def test_a_hash_recorded_on_one_rank_only_fails() -> None:
    result = _judge("x", {0: _records(hash_at=(3, 5)), 1: _records(hash_at=(5,))})
    assert result.status == "fail" and result.first_divergent_step == 3
    assert "differs on logical rank 1 from logical rank 0 (rank 0: 'aa" in result.detail
    assert result.detail.endswith("rank 1: nothing)")


def test_a_rank_missing_steps_fails() -> None:
    result = _judge("x", {0: _records(), 1: _records()[:3]})
    assert result.status == "fail" and result.first_divergent_step == 4
    assert "logical rank 1 is missing steps 4-5" in result.detail


def test_no_records_fail() -> None:
    assert _judge("x", {}).status == "fail"
    assert _judge("x", {0: [], 1: []}).status == "fail"
    silent = _judge("x", {0: _records(), 1: []})
    assert silent.status == "fail" and "logical rank 1 recorded nothing" in silent.detail


def test_records_without_any_hash_fail_since_drift_would_go_unseen() -> None:
    result = _judge("x", {0: _records(hash_at=()), 1: _records(hash_at=())})
    assert result.status == "fail" and "no replicated-parameter hash" in result.detail


DRIFT = """
import torch

from harness.reference.train import Trainer

original = Trainer._rank_step


def drifting_step(self, rank, step):
    if rank == 1 and step == 2:  # logical rank 1's replica of lm_head drifts before step 2
        with torch.no_grad():
            self.replicas[rank].model.lm_head.weight[0, 0] += 1e-3
    return original(self, rank, step)


Trainer._rank_step = drifting_step
"""


def test_a_replica_that_drifts_on_one_logical_rank_exits_1_naming_ranks_agree(
    run_harness, plant, tmp_path: Path
) -> None:
    """Both arms drift alike, so they still match each other: only ranks-agree can see it."""
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 3, "--out", out, env=plant(DRIFT))
    assert run.returncode == 1, run.stdout + run.stderr
    failed = {c["name"] for c in run.summary(out)["checks"] if c["status"] != "pass" and c["kind"] != "golden"}
    assert failed == {"procs: ranks-agree", "inproc: ranks-agree"}, failed
    check = run.check(out, "procs: ranks-agree")
    assert check["first_divergent_step"] == 3  # hashed at the last step
    assert check["detail"].startswith("step 3: replicated_hash differs on logical rank 1 from logical rank 0")


def test_a_line_without_its_loss_is_unreadable_naming_the_file_and_record(tmp_path: Path) -> None:
    """A renamed key fails where the line is read, not as a rank whose loss reads "nothing"."""
    path = tmp_path / "ranks.rank1.jsonl"
    with pytest.raises(RecordError, match=r"ranks.rank1.jsonl: record 2: loss is None"):
        RankLine.from_json({"step": 2, "los": 4.8, "grad_norm": 1.2}, path, 2)
    assert RankLine.from_json({"step": 2, "loss": 4.8, "grad_norm": 1.2}, path, 2).replicated_hash is None
