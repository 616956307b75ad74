"""The `fidelity-torchtitan` suite: the reference trained in lockstep with torchtitan's own DeepSeek-V3
(0.3.0, installed by the `test` extra), and what the oracle refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from suite_files import refused_without, suite_error

from harness.records import read_jsonl

ARMS = ("learned", "learned-one-process", "forced")

SUITE = """
name = "mini"
description = "a torchtitan arm"
ranks = 2
steps = 2
[model]
config = "cpu-tiny-learned"
[train]
routing = "learned"
[arms.titan]
oracle = "torchtitan"
"""


def _fidelity(run, out: Path) -> dict[str, dict]:
    return {c["name"]: c for c in run.summary(out)["checks"] if c["kind"] == "fidelity"}


def test_the_suite_passes_against_torchtitan_on_both_ep_layouts_and_routings(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "fidelity-torchtitan", "--ranks", 2, "--out", out, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    checks = _fidelity(run, out)
    assert set(checks) == {f"{arm}: fidelity" for arm in ARMS}
    assert all(c["status"] == "pass" and "of torchtitan" in c["detail"] for c in checks.values()), checks
    for arm in ARMS:
        lines = read_jsonl(out / "arms" / arm / "fidelity.jsonl")
        assert [r["step"] for r in lines] == [1, 2, 3, 4]
        assert {r["oracle"] for r in lines} == {"torchtitan"}
        # EP=2 on 2 processes runs torchtitan's own expert parallelism; in one process, all its experts.
        assert {r["oracle_processes"] for r in lines} == {1 if arm == "learned-one-process" else 2}
        # Every parameter, experts included, under the reference's names, with a gradient to compare.
        assert all(len(r["params"]) == 45 for r in lines)
        assert all(p["grad_oracle_max"] > 0 for r in lines for p in r["params"].values())
        metrics = read_jsonl(out / "arms" / arm / "metrics.jsonl")
        assert [r["loss"] for r in lines] == [m["loss"] for m in metrics]
    assert "FAIL" not in run.stdout


def test_the_routed_scaling_factor_applied_twice_fails_naming_the_step_and_tensor(run_harness, tmp_path: Path) -> None:
    """Every arm of the reference applies it twice alike, so only an oracle sees it."""
    out = tmp_path / "run"
    args = ("--ranks", 2, "--steps", 1, "--set", "train.fault=routed-scaling-twice", "--out", out)
    run = run_harness("run", "fidelity-torchtitan", *args, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    checks = _fidelity(run, out)
    assert set(checks) == {f"{arm}: fidelity" for arm in ARMS}
    for check in checks.values():
        assert check["status"] == "fail" and check["first_divergent_step"] == 1, check
        tensor = r"step 1: model\.layers\.\d\.mlp\.(experts|gate)\.\S+ (grad|adam_[mv]) rel err"
        assert re.match(tensor, check["detail"]), check["detail"]
        assert check["detail"].endswith("(against torchtitan)"), check["detail"]


# Each adjustment of torchtitan's expert parallelism undone (harness/oracles/torchtitan.py).
DEFAULT_SPMD_BACKEND = """
import harness.oracles.torchtitan as titan

titan.SPMD_BACKEND = "spmd_types"
"""
MESH_ON_TORCHTITANS_DEVICE_TYPE = """
import types

import harness.oracles.torchtitan as titan

titan.parallel_dims = types.SimpleNamespace(ParallelDims=titan.parallel_dims.ParallelDims)
"""


@pytest.mark.parametrize(
    "undone", [DEFAULT_SPMD_BACKEND, MESH_ON_TORCHTITANS_DEVICE_TYPE], ids=["spmd-backend", "device-type"]
)
def test_each_adjustment_of_torchtitans_expert_parallelism_is_needed(
    run_harness, plant, tmp_path: Path, undone: str
) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "fidelity-torchtitan", "--ranks", 2, "--steps", 1, "--out", out, env=plant(undone))
    assert run.returncode == 3, run.stdout + run.stderr
    assert "ERROR  launch: learned+forced" in run.stdout, run.stdout


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ('config = "cpu-tiny-learned"', 'config = "cpu-tiny-learned"\nrope_type = "yarn"\nrope_factor = 4.0'),
            "FILE: arms.titan.oracle: needs a model with rope_type 'default': torchtitan does not scale cos/sin"
            " for yarn",
        ),
        (
            ('routing = "learned"', 'routing = "learned"\nprecision = "bf16-mixed"'),
            'FILE: arms.titan.oracle: needs precision = "pure" in dtype float32: the torchtitan oracle is held'
            " to fp32 bits",
        ),
        (
            ('routing = "learned"', 'routing = "learned"\ndelay = 1'),
            "FILE: arms.titan.oracle: needs a plain arm: torchtitan's model has no delayed pipeline or PEC embedding"
            " (unset their fields)",
        ),
    ],
    ids=["yarn", "bf16-mixed", "versioned"],
)
def test_what_torchtitan_has_no_counterpart_of_is_refused_naming_the_field(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    assert suite_error(tmp_path, SUITE.replace(*change)) == expected


def test_without_torchtitan_the_suite_is_refused_with_the_install_line(harness_main, tmp_path: Path) -> None:
    assert refused_without(harness_main, tmp_path, "torchtitan", "fidelity-torchtitan") == (
        "error: suites/fidelity-torchtitan.toml: arms.learned.oracle: needs torchtitan, which is not installed:"
        " pip install -c constraints.txt 'harness[torchtitan]'\n"
    )
