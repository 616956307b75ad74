"""The final-weights check family on hand-made records: identical digests pass, anything else fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.checks import FAMILIES
from harness.records import ArmRecords
from harness.suites import load_suite

SUITE = """
name = "weights"
description = "two arms whose final weights must match"
ranks = 2
steps = 3
[arms.a]
[arms.b]
[[checks]]
kind = "final-weights"
"""


def _weights(updates: int = 3, **changed: str) -> dict:
    return {"updates": updates, "parameters": {"embed": "e" * 64, "head": "h" * 64, **changed}}


@pytest.mark.parametrize(
    "b_weights,status,detail",
    [
        (
            {0: _weights(), 1: _weights()},
            "pass",
            "2 parameters bitwise identical on all 2 logical ranks after 3 updates",
        ),
        ({0: _weights()}, "fail", "logical rank 1: no final weights recorded by arm b"),
        (
            {0: _weights(), 1: _weights(head="0" * 64)},
            "fail",
            "logical rank 1: 1 of 2 parameters differ after 3 updates: head",
        ),
        ({0: _weights(2), 1: _weights()}, "fail", "logical rank 0: a recorded weights after 3 updates, b after 2"),
        ({0: {"updates": 3}, 1: _weights()}, "fail", "logical rank 0: malformed final weights of arm b"),
    ],
    ids=["identical", "missing", "differing", "fewer-updates", "malformed"],
)
def test_final_weights_pass_only_on_identical_digests_of_every_logical_rank(
    tmp_path: Path, b_weights: dict, status: str, detail: str
) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    suite = load_suite(str(path))
    check = suite.checks[0]
    records = {"a": ArmRecords(final_weights={0: _weights(), 1: _weights()}), "b": ArmRecords(final_weights=b_weights)}
    [result] = FAMILIES[check.kind].run(check, suite, records)
    assert (result.name, result.status, result.detail) == ("a vs b, final weights", status, detail)


def test_no_final_weights_at_all_fails(tmp_path: Path) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    suite = load_suite(str(path))
    [result] = FAMILIES["final-weights"].run(suite.checks[0], suite, {"a": ArmRecords(), "b": ArmRecords()})
    assert result.status == "fail" and result.detail == (
        "logical rank 0: no final weights recorded by arm a and b (and 1 more)"
    )
