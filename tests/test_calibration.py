"""Calibrated cross-environment tiers (harness/calibration.py, golden.Calibration): the noise measured
between environments, the tier it gives, and a change at three times that tier caught where the
fixed cross-environment tier passed it."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.calibration import measure_noise, noise_for_tiers, relative_noise
from harness.checks.golden import golden_checks
from harness.golden import Calibration, GoldenError, golden_from_metrics, load_golden, write_golden
from harness.golden_plan import GoldenPlan, plan_golden

REPO = Path(__file__).resolve().parents[1]
PINNED = "cpu-pinned-avx2-amd-gloo-float32-torch2.13"
NATIVE = "cpu-native-avx512-amd-gloo-float32-torch2.13"
CONFIG = {"steps": 5, "arms": {"eager": {"ranks": 2, "config": {}}}}
FIXED = {"kind": "close", "rtol": 1e-4, "atol": 0.0}
PROVENANCE = {
    "torch": "2.13.0+cpu",
    "device": "cpu-native-avx512-amd",
    "backend": "gloo",
    "dtype": "float32",
    "harness": "0.1.0",
    "git_sha": "abc123",
    "date": "2026-01-01T00:00:00Z",
}
# Float32 noise of the size measured between AMD and Intel: ten times it is the tier.
CALIBRATION = Calibration({"loss": 2e-7, "grad_norm": 5e-7}, 10.0, ("cpu-isa avx2 vs cpu-isa avx512",))


def frame(loss_scale: float = 1.0) -> pd.DataFrame:
    loss = np.linspace(2.3, 1.1, 5)
    return pd.DataFrame({"loss": loss * loss_scale, "grad_norm": loss / 3}, index=pd.RangeIndex(5, name="step"))


def record(tmp_path, calibration: Calibration | None, key: str = NATIVE):
    provenance = {**PROVENANCE, **({"calibration": calibration.to_json()} if calibration else {})}
    golden = golden_from_metrics("parity", key, provenance, CONFIG, {"kind": "exact"}, {"eager": frame()})
    path = tmp_path / "parity" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_golden(path, golden)
    return path


def test_noise_is_the_largest_relative_difference_either_way_round() -> None:
    a = pd.Series([1.0, 2.0, 4.0, math.nan])
    b = pd.Series([1.0, 2.0 * (1 + 3e-7), 4.0 * (1 - 1e-7), math.nan])  # NaN in both: they agree
    assert relative_noise(a, b) == relative_noise(b, a) == pytest.approx(3e-7, rel=1e-6)
    assert relative_noise(a, a) == 0.0
    assert relative_noise(a, pd.Series([1.0, 2.0, 4.0, 5.0])) == math.inf  # NaN on one side only
    assert relative_noise(a, pd.Series([1.0], index=[7])) == 0.0  # no step in common


def test_the_noise_of_a_metric_is_its_worst_pair_arm_and_step() -> None:
    moved = frame()
    moved.loc[3, "grad_norm"] *= 1 + 4e-7
    sources = {
        "cpu-isa avx2": {"eager": dict(frame().items()), "graph": dict(frame().items())},
        "cpu-isa avx512": {"eager": dict(frame(1 + 1e-7).items()), "graph": dict(frame().items())},
        "golden intel": {"graph": dict(moved.items())},
    }
    noise, pairs = measure_noise(sources, ("loss", "grad_norm"))
    assert noise["loss"] == pytest.approx(1e-7, rel=1e-6) and noise["grad_norm"] == pytest.approx(4e-7, rel=1e-6)
    assert pairs == ["cpu-isa avx2 vs cpu-isa avx512", "cpu-isa avx2 vs golden intel", "cpu-isa avx512 vs golden intel"]


def test_a_calibrated_golden_holds_another_environment_at_ten_times_the_noise_and_fails_three_times_the_tier(
    tmp_path,
) -> None:
    other = record(tmp_path, CALIBRATION)
    plan = plan_golden("parity", CONFIG, PINNED, "check", tmp_path, FIXED)
    how = "calibrated: loss within rtol=2e-06, grad_norm within rtol=5e-06 (10x the noise measured)"
    assert plan.cross_env and plan.note.endswith(f"parity/{other.name}, {how}")
    assert GoldenPlan.from_record(json.loads(json.dumps(plan.record))).how == how  # harness collect's
    noisy = frame(1 + 2e-7)  # the noise measured: passes
    assert all(r.status == "pass" for r in golden_checks(plan, {"eager": noisy}, steps=5))
    changed = frame(1 + 3 * 2e-6)  # three times the loss tier
    results = {r.name: r for r in golden_checks(plan, {"eager": changed}, steps=5)}
    assert results["golden:eager:loss"].status == "fail" and results["golden:eager:grad_norm"].status == "pass"
    assert "rtol=2e-06" in results["golden:eager:loss"].detail
    # The fixed tier it replaces passes the same change: what hid real bugs.
    record(tmp_path, None)
    fixed = plan_golden("parity", CONFIG, PINNED, "check", tmp_path, FIXED)
    assert fixed.note.endswith("within rtol=0.0001 atol=0")
    assert all(r.status == "pass" for r in golden_checks(fixed, {"eager": changed}, steps=5))


def test_a_failure_of_the_own_golden_is_judged_for_drift_at_the_calibrated_tier(tmp_path) -> None:
    run_env = {**PROVENANCE, "torch": "2.14.0+cpu"}  # the environment moved: drift if the numbers barely did
    changed = frame(1 + 3 * 2e-6)
    labels = {}
    for calibrated in (None, CALIBRATION):
        record(tmp_path, calibrated, key=PINNED)
        plan = plan_golden("parity", CONFIG, PINNED, "check", tmp_path, FIXED, run_env)
        results = golden_checks(plan, {"eager": changed}, steps=5, cross_env_tier=FIXED)
        [failed] = [r for r in results if r.status == "fail"]
        labels[calibrated is not None] = failed.label
    assert labels == {False: "drift", True: "regression"}


@pytest.mark.parametrize(
    ("calibration", "field"),
    [
        ({"noise": {"loss": 1e-7}, "margin": 0.5, "measured": ["a vs b"]}, "provenance.calibration.margin"),
        ({"noise": {"loss": -1}, "margin": 10, "measured": ["a vs b"]}, "provenance.calibration.noise.loss"),
        ({"noise": {}, "margin": 10, "measured": ["a vs b"]}, "provenance.calibration.noise"),
        ({"noise": {"loss": 1e-7}, "margin": 10, "measured": []}, "provenance.calibration.measured"),
        ({"noise": {"loss": 1e-7}, "margin": 10}, "provenance.calibration"),
    ],
    ids=["margin-below-1", "negative-noise", "no-metric", "nothing-measured", "missing-field"],
)
def test_a_bad_calibration_is_refused_naming_its_field(tmp_path, calibration: dict, field: str) -> None:
    path = record(tmp_path, None)
    raw = json.loads(path.read_text())
    raw["provenance"]["calibration"] = calibration
    path.write_text(json.dumps(raw))
    with pytest.raises(GoldenError) as refused:
        load_golden(path)
    assert str(refused.value).startswith(f"{path}: {field}: ")


def test_a_metric_that_did_not_move_takes_the_largest_noise_of_the_suite() -> None:
    assert noise_for_tiers({"loss": 0.0, "grad_norm": 1.1e-7}) == {"loss": 1.1e-7, "grad_norm": 1.1e-7}
    assert noise_for_tiers({"loss": 2e-8, "grad_norm": 1.1e-7}) == {"loss": 2e-8, "grad_norm": 1.1e-7}
    assert noise_for_tiers({"loss": 0.0, "grad_norm": 0.0}) == {"loss": 0.0, "grad_norm": 0.0}


def test_the_docs_table_of_calibrated_tiers_is_what_the_shipped_goldens_hold() -> None:
    """docs/goldens.md's table, row by row, against the calibration in each suite's AMD golden."""
    text = (REPO / "docs" / "goldens.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `") and line.count("|") == 7]
    shown = {row.split("`")[1]: [cell.strip() for cell in row.split("|")[2:7]] for row in rows}
    assert set(shown) == {path.name for path in (REPO / "golden").iterdir()}
    for suite, (vendors, *figures) in shown.items():
        [path] = (REPO / "golden" / suite).glob("cpu-pinned-avx2-amd-*.json")
        calibration = load_golden(path).calibration
        assert calibration is not None, f"{path}: not calibrated"
        measured = "AMD, Intel" if any("intel" in pair for pair in calibration.measured) else "AMD"
        noise = calibration.noise
        expected = [noise["loss"], noise["grad_norm"], 10 * noise["loss"], 10 * noise["grad_norm"]]
        assert [vendors, *figures] == [measured, *(f"{x:.2g}" for x in expected)], suite
