"""The `parity` suite end to end: graph chunking matches eager chunking, and each planted graph
bug is caught by a check that names it (exit 1), on real 2-rank gloo runs."""

from __future__ import annotations

from pathlib import Path

import pytest


def failing(run, out: Path) -> set[str]:
    return {c["name"] for c in run.summary(out)["checks"] if c["status"] == "fail"}


def test_parity_passes_with_golden_and_four_chunks(run_harness, tmp_path: Path) -> None:
    goldens = ("--golden-dir", tmp_path / "golden")
    update = run_harness(
        "golden", "update", "parity", "--ranks", 2, "--steps", 3, *goldens, "--out", tmp_path / "update"
    )
    assert update.returncode == 0, update.stdout + update.stderr
    out = tmp_path / "two"
    run = run_harness("run", "parity", "--ranks", 2, "--steps", 3, "--golden", "check", *goldens, "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    names = {c["name"]: c["status"] for c in run.summary(out)["checks"]}
    assert names["eager vs graph: loss"] == names["eager-traced vs graph: events"] == "pass"
    assert names["golden:graph:grad_norm"] == "pass"
    assert names["graph: graph:buffer-set-pass"] == "pass"

    out = tmp_path / "four"
    run = run_harness("run", "parity", "--ranks", 2, "--steps", 2, "--set", "chunks=4", "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "graph: graph:exchange-counts" in {c["name"] for c in run.summary(out)["checks"]}


@pytest.mark.parametrize(
    "fault,caught_by",
    [
        (
            "skip-buffer-pass",
            {"graph: graph:buffer-sets", "graph: token-exchange:buffer-reuse", "eager vs graph: loss"},
        ),
        ("drop-wait", {"graph: graph:launch-wait-pairs", "graph: token-exchange:launch-wait-pairing"}),
        ("forward-order-backward", {"graph: graph:chunk-order", "eager-traced vs graph: events"}),
        ("clone-forward-only", {"graph: graph:buffer-set-pass", "graph: token-exchange:expected-counts"}),
    ],
)
def test_planted_graph_bug_fails_the_check_that_names_it(
    run_harness, tmp_path: Path, fault: str, caught_by: set[str]
) -> None:
    out = tmp_path / fault
    run = run_harness(
        "run",
        "parity",
        "--ranks",
        2,
        "--steps",
        1,
        "--golden",
        "off",
        "--set",
        f"arms.graph.fault={fault}",
        "--out",
        out,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert caught_by <= failing(run, out)
    assert run.summary(out)["verdict"] == "fail"
