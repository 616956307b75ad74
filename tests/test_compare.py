import json
import math

import numpy as np
import pandas as pd
import pytest

from harness.compare import (
    Band,
    CheckResult,
    Close,
    Exact,
    Ulp,
    compare_arms,
    compare_series,
    format_steps,
    tier_from_spec,
    ulp_distance,
)

LOSS = [2.0794415416798357, 1.9, 1.75, 1.6, 1.52, 1.41, 1.33, 1.30, 1.22, 1.15]


def series(values, start=0):
    return pd.Series(values, index=pd.RangeIndex(start, start + len(values), name="step"), dtype="float64")


def bumped(values, step, ulps=1):
    out = list(values)
    for _ in range(ulps):
        out[step] = float(np.nextafter(out[step], math.inf))
    return out


def test_exact_passes_identical_trajectories():
    r = compare_series("loss", series(LOSS), series(LOSS), Exact(), label_a="eager", label_b="graph")
    assert r.status == "pass"
    assert r.max_abs_diff == 0.0 and r.first_divergent_step is None
    assert r.detail == "10 steps bitwise identical"


def test_exact_catches_one_ulp_and_reports_first_divergent_step():
    b = bumped(LOSS, 3)
    b[6] += 1e-3
    r = compare_series("loss", series(LOSS), series(b), Exact(), label_a="eager", label_b="graph")
    assert r.status == "fail"
    assert r.first_divergent_step == 3
    assert r.values == {"eager": LOSS[3], "graph": b[3]}
    assert r.max_abs_diff == pytest.approx(1e-3)
    assert r.detail.startswith(f"first divergence at step 3: eager={LOSS[3]!r} graph={b[3]!r}")
    assert "2 of 10 steps not bitwise identical" in r.detail


def test_exact_treats_signed_zero_as_divergence_but_ulp_does_not():
    a, b = series([1.0, 0.0]), series([1.0, -0.0])
    assert compare_series("x", a, b, Exact()).first_divergent_step == 1
    assert compare_series("x", a, b, Ulp(0)).status == "pass"


def test_ulp_distance_counts_representable_doubles_across_zero():
    tiny = 5e-324
    d = ulp_distance(np.array([1.0, -tiny, -1.0, 0.0]), np.array([np.nextafter(1.0, 2.0), tiny, -1.0, -0.0]))
    assert d.tolist() == [1, 2, 0, 0]
    extremes = ulp_distance(np.array([-1.7976931348623157e308]), np.array([1.7976931348623157e308]))
    assert int(extremes[0]) == 2 * 0x7FEFFFFFFFFFFFFF


def test_ulp_tier_allows_n_and_catches_n_plus_one():
    a = series(LOSS)
    assert compare_series("loss", a, series(bumped(LOSS, 5, ulps=4)), Ulp(4)).status == "pass"
    r = compare_series("loss", a, series(bumped(LOSS, 5, ulps=5)), Ulp(4))
    assert r.status == "fail" and r.first_divergent_step == 5
    assert r.extra["max_ulps"] == 5


def test_close_uses_b_as_reference():
    a, b = series([1.0, 2.0, 100.5]), series([1.0, 2.0, 100.0])
    assert compare_series("x", a, b, Close(rtol=5e-3, atol=0.0)).status == "pass"
    r = compare_series("x", a, b, Close(rtol=4e-3, atol=0.0))
    assert r.status == "fail" and r.first_divergent_step == 2
    assert r.max_rel_diff == pytest.approx(0.005)
    assert compare_series("x", a, b, Close(rtol=0.0, atol=0.5)).status == "pass"


def _noisy(n=300, rel=0.0, seed=0):
    rng = np.random.default_rng(seed)
    ref = 10.0 * np.exp(-np.arange(n) / 100) + 1.0
    return ref, ref * (1 + rel * rng.uniform(-1, 1, n))


def test_band_passes_small_noise_and_uses_megatron_budget():
    ref, run = _noisy(rel=0.01)
    run[[10, 20, 30]] *= 1.2  # 3 outliers; budget for 300 steps is 300 // 100 = 3
    r = compare_series("loss", series(run), series(ref), Band(0.05, 0.05, 0.9))
    assert r.status == "pass", r.detail
    assert r.extra["budget"] == 3 and r.extra["steps_over_max_rel"] == 3


def test_band_catches_outliers_over_budget_at_first_outlier():
    ref, run = _noisy(rel=0.01)
    run[[10, 20, 30, 40]] *= 1.2
    r = compare_series("loss", series(run), series(ref), Band(0.05, 0.05, 0.9))
    assert r.status == "fail" and r.first_divergent_step == 10
    assert "4 steps over max_rel 0.05 (budget 3)" in r.detail
    assert compare_series("loss", series(run), series(ref), Band(0.05, 0.05, 0.9, max_failing_steps=4)).status == "pass"


def test_band_catches_final_value_drift():
    ref, run = _noisy()
    run[-1] *= 1.04
    r = compare_series("loss", series(run), series(ref), Band(max_rel=0.05, final_rel=0.01, min_corr=0.9))
    assert r.status == "fail" and r.first_divergent_step == len(ref) - 1
    assert "final rel 0.04 > 0.01" in r.detail


def test_band_catches_uncorrelated_trajectory():
    ref = 2.0 + 0.01 * np.sin(np.arange(200))
    run = 2.0 + 0.01 * np.cos(np.arange(200))  # within 1.5% everywhere but not the same curve
    r = compare_series("loss", series(run), series(ref), Band(max_rel=0.05, final_rel=0.05, min_corr=0.9))
    assert r.status == "fail" and r.first_divergent_step is None
    assert "correlation" in r.detail and r.extra["corr"] < 0.9


def test_band_constant_trajectory_has_undefined_correlation():
    r = compare_series("x", series([1.0] * 12), series([1.0] * 11 + [1.01]), Band(0.05, 0.05, 0.5))
    assert r.status == "fail" and "undefined" in r.detail


def test_band_reports_but_does_not_judge_correlation_of_a_few_steps():
    ref = [2.0, 1.99, 2.0, 1.99, 2.0]
    run = [1.99, 2.0, 1.99, 2.0, 2.0]  # anti-correlated noise, well inside the band
    r = compare_series("loss", series(run), series(ref), Band(0.05, 0.05, 0.9))
    assert r.status == "pass" and r.extra["corr"] < 0 and "not judged under 10 steps" in r.detail
    longer = compare_series("loss", series(run * 2), series(ref * 2), Band(0.05, 0.05, 0.9))
    assert longer.status == "fail" and "correlation" in longer.detail


def test_arm_cut_short_fails_naming_arm_and_step():
    r = compare_series("loss", series(LOSS), series(LOSS[:8]), Exact(), label_a="eager", label_b="graph")
    assert r.status == "fail"
    assert r.detail.startswith("arm 'graph' stops at step 7 of 10 (missing 8-9)")
    assert r.first_divergent_step == 8


def test_gap_in_steps_fails_naming_missing_steps():
    a = series(LOSS)
    b = a.drop([3, 4, 6])
    r = compare_series("loss", a, b, Close(1.0, 1.0), label_a="eager", label_b="graph")
    assert r.status == "fail" and r.detail == "arm 'graph' is missing steps 3-4, 6"
    assert r.first_divergent_step == 3


def test_empty_arm_and_empty_comparison_fail():
    r = compare_series("loss", series(LOSS), series([]), Exact(), label_a="eager", label_b="graph")
    assert r.status == "fail" and "arm 'graph' has no values" in r.detail
    assert compare_series("loss", series([]), series([]), Exact()).status == "fail"


@pytest.mark.parametrize("tier", [Exact(), Ulp(1000), Close(1.0, 1.0), Band(1.0, 1.0, -1.0)])
def test_non_finite_fails_in_every_tier_naming_the_arm(tier):
    b = list(LOSS)
    b[4] = math.nan
    r = compare_series("loss", series(LOSS), series(b), tier, label_a="eager", label_b="graph")
    assert r.status == "fail" and r.first_divergent_step == 4
    assert r.detail.startswith("non-finite value in arm 'graph' at step 4")
    both = compare_series("loss", series(b), series(b), tier, label_a="eager", label_b="graph")
    assert both.status == "fail" and "arm 'eager' and 'graph'" in both.detail


def test_compare_arms_missing_metric_names_arm():
    a = pd.DataFrame({"loss": LOSS}).rename_axis("step")
    b = pd.DataFrame({"grad_norm": LOSS}).rename_axis("step")
    r = compare_arms("exact:loss", a, b, "loss", Exact(), "eager", "graph")
    assert r.status == "fail" and r.detail == "metric 'loss' missing from arm 'graph'"
    assert compare_arms("exact:loss", a, a, "loss", Exact(), "eager", "graph").status == "pass"


def test_check_result_to_dict_is_json_ready_and_exact():
    b = bumped(LOSS, 2)
    r = compare_series("loss", series(LOSS), series(b), Exact(), label_a="eager", label_b="graph")
    back = json.loads(json.dumps(r.to_dict()))
    assert back["first_divergent_step"] == 2 and type(r.to_dict()["first_divergent_step"]) is int
    assert back["values"] == {"eager": LOSS[2], "graph": b[2]}
    assert back["max_abs_diff"] == r.max_abs_diff
    assert set(back) == {f for f in CheckResult.__dataclass_fields__}


@pytest.mark.parametrize(
    "spec, tier",
    [
        ({"kind": "exact", "metrics": ["loss"]}, Exact()),
        ({"kind": "ulp", "ulps": 4}, Ulp(4)),
        ({"kind": "close", "rtol": 1e-4, "atol": 1e-5}, Close(1e-4, 1e-5)),
        ({"kind": "band", "max_rel": 0.05, "final_rel": 0.05, "min_corr": 0.9}, Band(0.05, 0.05, 0.9)),
        (
            {"kind": "band", "max_rel": 0.05, "final_rel": 0.05, "min_corr": 0.9, "max_failing_steps": 2},
            Band(0.05, 0.05, 0.9, 2),
        ),
    ],
)
def test_tier_from_spec_round_trips(spec, tier):
    assert tier_from_spec(spec) == tier
    assert tier_from_spec(tier.spec()) == tier


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"kind": "exactly"}, "'kind'"),
        ({}, "'kind'"),
        ({"kind": "ulp"}, "'ulps'"),
        ({"kind": "ulp", "ulps": -1}, "'ulps'"),
        ({"kind": "ulp", "ulps": 1.5}, "'ulps'"),
        ({"kind": "close", "rtol": 1e-4}, "'atol'"),
        ({"kind": "close", "rtol": "1e-4", "atol": 0}, "'rtol'"),
        ({"kind": "close", "rtol": math.nan, "atol": 0}, "'rtol'"),
        ({"kind": "close", "rtol": 1e-4, "atol": 0, "rtoll": 1}, "'rtoll'"),
        ({"kind": "band", "max_rel": 0.05, "final_rel": 0.05, "min_corr": 1.5}, "'min_corr'"),
        (
            {"kind": "band", "max_rel": 0.05, "final_rel": 0.05, "min_corr": 0.9, "max_failing_steps": True},
            "'max_failing_steps'",
        ),
    ],
)
def test_tier_from_spec_names_the_bad_field(spec, field):
    with pytest.raises(ValueError, match=field):
        tier_from_spec(spec)


def test_format_steps_compresses_ranges():
    assert format_steps([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert format_steps(list(range(0, 40, 2)), limit=2) == "0, 2, ... (20 steps)"
