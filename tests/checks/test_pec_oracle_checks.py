"""The pec-oracle check on recorded lines: it names the first batch beyond the tolerance, its table and
worst row; NaN, no records, a batch missing or a malformed line never pass."""

from __future__ import annotations

import math

import pytest

from harness.checks.pec_oracle import NO_RECORDS, judge


def line(step: int, rel: float = 1e-7, row: int = 3) -> dict:
    table = {"rows": 256, "max_rel_err": rel, "worst_row": row, "abs_diff": rel * 0.02}
    return {"step": step, "oracle": "torchrec", "tables": {"model.embed_tokens": table}}


def test_within_the_tolerance_passes_naming_the_worst_row_seen() -> None:
    result = judge("a: pec-oracle", [line(1), line(2, 4e-7, 17), line(3)], 3, 1e-6)
    assert result.status == "pass"
    assert result.detail == (
        "batches 1-3: every row of model.embed_tokens within 1e-06 of torchrec's; worst 4.0e-07"
        " (model.embed_tokens row 17, batch 2)"
    )


@pytest.mark.parametrize("rel", [2e-6, math.nan, math.inf])
def test_the_first_batch_beyond_the_tolerance_fails_naming_table_and_row(rel: float) -> None:
    result = judge("a: pec-oracle", [line(1), line(2, rel, 41), line(3, 1.0, 5)], 3, 1e-6)
    assert result.status == "fail" and result.first_divergent_step == 2
    assert result.detail.startswith(f"batch 2: model.embed_tokens row 41 rel err {rel:.1e} > 1e-06 (abs diff ")


@pytest.mark.parametrize(
    "lines,detail",
    [
        ([], NO_RECORDS),
        ([line(1), line(3)], "recorded batches [1, 3], expected 1-3: the batches missing were not compared"),
        (
            [line(1), line(2), line(2), line(3)],
            "recorded batches [1, 2, 2, 3], expected 1-3: the batches missing were not compared",
        ),
    ],
)
def test_missing_batches_fail(lines: list[dict], detail: str) -> None:
    result = judge("a: pec-oracle", lines, 3, 1e-6)
    assert (result.status, result.detail) == ("fail", detail)


def test_a_line_without_its_tables_is_an_error() -> None:
    result = judge("a: pec-oracle", [line(1), {"step": 2, "tables": {}}, line(3)], 3, 1e-6)
    assert (result.status, result.detail) == ("error", "batch 2: malformed record: no tables")
