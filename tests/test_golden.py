import json
import math
import os
import time

import numpy as np
import pandas as pd
import pytest

from harness.checks.golden import compare_to_golden, golden_checks
from harness.compare import Close, Exact
from harness.environment import comparable_env_keys, env_key
from harness.golden import (
    GoldenError,
    config_differences,
    diff_summary,
    fingerprint_changes,
    golden_from_metrics,
    load_golden,
    shown_path,
    write_golden,
)
from harness.golden_plan import GoldenPlan, golden_config, plan_golden, rebless_command, update_golden
from harness.manifest import Manifest
from harness.shipped import SOURCE_ROOT
from harness.suites import load_suite

KEY = "cpu-gloo-float32-torch2.13"
CONFIG = {"steps": 5, "arms": {"eager": {"ranks": 2, "config": {"chunks": 2}}, "graph": {"ranks": 2, "config": {}}}}
CROSS_ENV = {"kind": "close", "rtol": 1e-4, "atol": 0.0}
PROVENANCE = {
    "torch": "2.13.0+cpu",
    "device": "cpu",
    "backend": "gloo",
    "dtype": "float32",
    "harness": "0.1.0",
    "git_sha": "abc123",
    "date": "2026-01-01T00:00:00Z",
}


def frame(scale=1.0, steps=5):
    rng = np.random.default_rng(1)
    loss = (np.linspace(2.3, 1.1, steps) + rng.uniform(0, 1e-3, steps)) * scale
    return pd.DataFrame(
        {"loss": loss, "grad_norm": loss / 3, "tokens": 256, "step_time_s": 0.01},
        index=pd.RangeIndex(steps, name="step"),
    )


def make(metrics=None, key=KEY, config=CONFIG, provenance=PROVENANCE, **kw):
    metrics = metrics or {"eager": frame(), "graph": frame()}
    return golden_from_metrics("parity", key, provenance, config, {"kind": "exact", "metrics": ["loss"]}, metrics, **kw)


@pytest.mark.parametrize(
    "args, key",
    [
        (("cpu", "gloo", "float32", "2.13.0+cpu"), "cpu-gloo-float32-torch2.13"),
        (("cuda-h200", "nccl", "torch.bfloat16", "2.13.1"), "cuda-h200-nccl-bfloat16-torch2.13"),
        (("NVIDIA H200", "NCCL", "bfloat16", "2.14.0.dev20260101"), "nvidia-h200-nccl-bfloat16-torch2.14"),
    ],
)
def test_env_key(args, key):
    assert env_key(*args) == key


def test_env_key_rejects_bad_version():
    with pytest.raises(ValueError, match="torch version"):
        env_key("cpu", "gloo", "float32", "nightly")


def test_write_then_load_is_bit_exact(tmp_path):
    golden = make()
    path = tmp_path / "golden" / "parity" / f"{KEY}.json"
    write_golden(path, golden)
    back = load_golden(path)
    assert back.suite == "parity" and back.env_key == KEY and back.provenance == PROVENANCE
    assert back.tier == {"kind": "exact"}
    assert set(back.arms) == {"eager", "graph"} and set(back.arms["eager"]) == {"loss", "grad_norm"}
    expected = frame()["loss"].to_numpy()
    assert np.array_equal(back.arms["eager"]["loss"].to_numpy().view(np.int64), expected.view(np.int64))
    on_disk = json.loads(path.read_text())
    assert on_disk["arms"]["eager"]["loss"]["start_step"] == 0 and on_disk["arms"]["eager"]["loss"]["end_step"] == 4
    assert on_disk["arms"]["eager"]["loss"]["values"]["0"] == expected[0]


def test_golden_recorded_by_an_installed_harness_has_no_git_sha(tmp_path):
    golden = golden_from_metrics(
        "parity", KEY, {**PROVENANCE, "git_sha": None}, CONFIG, {"kind": "exact"}, {"eager": frame()}
    )
    path = tmp_path / "parity" / f"{KEY}.json"
    write_golden(path, golden)
    assert load_golden(path).provenance["git_sha"] is None


def test_update_removes_the_temp_file_a_killed_update_left_but_not_a_concurrent_ones(tmp_path):
    path = tmp_path / "parity" / f"{KEY}.json"
    path.parent.mkdir()
    killed, writing = path.parent / f".{path.name}.k1ll3d_x.tmp", path.parent / f".{path.name}.wr1t1ng.tmp"
    other_golden = path.parent / ".cuda-h200-nccl-bfloat16-torch2.13.json.k1ll3d_y.tmp"
    for temp in (killed, writing, other_golden):
        temp.write_text('{"schema": ')
    an_hour_ago = time.time() - 3600
    for temp in (killed, other_golden):
        os.utime(temp, (an_hour_ago, an_hour_ago))
    write_golden(path, make())
    assert load_golden(path).env_key == KEY
    assert not killed.exists(), "write_golden: expected the stale temp file of its golden removed"
    assert writing.exists(), "write_golden: expected a recent temp file (a concurrent update's) kept"
    assert other_golden.exists(), "write_golden: expected another golden's temp file left alone"
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, writing.name, other_golden.name])


def test_write_golden_refuses_mismatched_file_name(tmp_path):
    with pytest.raises(ValueError, match=KEY):
        write_golden(tmp_path / "other.json", make())


def test_golden_from_metrics_refuses_missing_and_non_finite():
    with pytest.raises(ValueError, match="arm 'graph' has no 'grad_norm'"):
        make({"eager": frame(), "graph": frame()[["loss"]]})
    bad = frame()
    bad.loc[3, "loss"] = math.nan
    with pytest.raises(ValueError, match="arm 'eager' loss is non-finite at steps 3"):
        make({"eager": bad})


def _write(tmp_path, obj, name=KEY):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return path


def _valid():
    return make().to_dict()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(schema=1), ": schema: expected 2, got 1 (recorded by an older harness"),
        (lambda d: d.pop("config"), ": config: expected an object with steps and arms"),
        (lambda d: d["config"].update(steps=0), ": config.steps: expected an integer >= 1, got 0"),
        (
            lambda d: d.update(env_key="cuda-nccl-float32-torch2.13"),
            ": env_key: 'cuda-nccl-float32-torch2.13' does not match",
        ),
        (lambda d: d["provenance"].pop("git_sha"), ": provenance.git_sha: expected a string or null"),
        (lambda d: d["provenance"].update(torch=None), ": provenance.torch: expected a string, got None"),
        (lambda d: d["provenance"].update(mkl=2024.2), ": provenance.mkl: expected a string or null, got 2024.2"),
        (lambda d: d.update(tier={"kind": "close", "rtol": 1e-4}), ": tier: close check: missing field 'atol'"),
        (
            lambda d: d["arms"]["eager"]["loss"].update(values=[1.0, 2.0]),
            ": arms.eager.loss.values: expected a mapping of step -> float",
        ),
        (
            lambda d: d["arms"]["eager"]["loss"]["values"].update({"2": "abc"}),
            ': arms.eager.loss.values.2: expected a finite number or "nan"',
        ),
        (
            lambda d: d["arms"]["eager"]["loss"]["values"].update({"2": True}),
            ": arms.eager.loss.values.2: expected a finite number",
        ),
        (
            lambda d: d["arms"]["eager"]["loss"]["values"].update({"x": 1.0}),
            ": arms.eager.loss.values: step 'x' is not an integer",
        ),
        (
            lambda d: d["arms"]["graph"]["grad_norm"].update(end_step=9),
            ": arms.graph.grad_norm: start_step/end_step 0/9 do not match",
        ),
        (lambda d: d["arms"].update(graph={}), ": arms.graph: expected a non-empty mapping"),
        (lambda d: d.update(extra=1), ": extra: unknown field"),
    ],
)
def test_load_golden_names_file_and_field(tmp_path, mutate, field):
    obj = _valid()
    mutate(obj)
    path = _write(tmp_path, obj)
    with pytest.raises(GoldenError) as exc:
        load_golden(path)
    message = str(exc.value)
    assert message.startswith(f"{path}{field}")
    assert "\n" not in message


def test_load_golden_rejects_non_finite_tokens_but_accepts_nan_string(tmp_path):
    obj = _valid()
    text = json.dumps(obj).replace(repr(obj["arms"]["eager"]["loss"]["values"]["1"]), "NaN", 1)
    with pytest.raises(GoldenError, match="values.1: expected a finite number"):
        load_golden(_write(tmp_path, text))
    obj["arms"]["eager"]["loss"]["values"]["1"] = "nan"
    golden = load_golden(_write(tmp_path, obj))
    assert math.isnan(golden.arms["eager"]["loss"][1])


def test_load_golden_corrupt_json_names_file(tmp_path):
    path = _write(tmp_path, '{"schema": 1, "suite": ')
    with pytest.raises(GoldenError, match=rf"^{path}: invalid JSON"):
        load_golden(path)
    with pytest.raises(GoldenError, match="cannot read"):
        load_golden(tmp_path / "missing.json")


def test_compare_to_golden_passes_same_run_and_catches_perturbation():
    golden = make()
    results = compare_to_golden(golden, {"eager": frame(), "graph": frame()}, Exact())
    assert [r.name for r in results] == [
        "golden:eager:loss",
        "golden:eager:grad_norm",
        "golden:graph:loss",
        "golden:graph:grad_norm",
    ]
    assert all(r.status == "pass" for r in results)
    drifted = frame()
    drifted.loc[2, "loss"] = float(np.nextafter(drifted.loc[2, "loss"], 0.0))
    results = compare_to_golden(golden, {"eager": frame(), "graph": drifted}, Exact())
    bad = [r for r in results if r.status != "pass"]
    assert [r.name for r in bad] == ["golden:graph:loss"]
    assert bad[0].first_divergent_step == 2 and set(bad[0].values) == {"graph", "golden"}
    assert compare_to_golden(golden, {"eager": frame(), "graph": drifted}, Close(1e-12, 0.0))[2].status == "pass"


def test_compare_to_golden_missing_arm_metric_and_extra_arm():
    golden = make()
    results = {r.name: r for r in compare_to_golden(golden, {"eager": frame()[["loss"]], "new": frame()}, Exact())}
    assert results["golden:graph:loss"].status == "fail" and "not in this run" in results["golden:graph:loss"].detail
    assert results["golden:eager:grad_norm"].detail == "metric 'grad_norm' missing from arm 'eager'"
    assert results["golden:new"].status == "fail"  # never a silent skip


def test_compare_to_golden_run_cut_short_fails():
    results = compare_to_golden(make(), {"eager": frame(steps=3), "graph": frame()}, Exact())
    assert results[0].status == "fail" and results[0].detail.startswith("arm 'eager' stops at step 2 of 5")


def test_diff_summary_reports_new_unchanged_changed_removed():
    old = make()
    assert diff_summary(None, old).splitlines() == [
        f"golden parity/{KEY}: new file",
        "  eager/loss: new (5 steps, 0..4)",
        "  eager/grad_norm: new (5 steps, 0..4)",
        "  graph/loss: new (5 steps, 0..4)",
        "  graph/grad_norm: new (5 steps, 0..4)",
    ]
    changed = frame()
    changed.loc[3, "loss"] += 1e-6
    new = golden_from_metrics(
        "parity",
        KEY,
        {**PROVENANCE, "torch": "2.13.1"},
        CONFIG,
        {"kind": "exact"},
        {"eager": changed, "extra": frame()},
        ("loss",),
    )
    lines = diff_summary(old, new).splitlines()
    assert lines[0] == f"golden parity/{KEY}: update"
    assert "  provenance.torch: 2.13.0+cpu -> 2.13.1" in lines
    [eager] = [line for line in lines if line.startswith("  eager/loss")]
    assert eager.startswith("  eager/loss: changed: first divergence at step 3:") and "max abs 1e-06" in eager
    assert "  extra/loss: new (5 steps, 0..4)" in lines
    assert {"  eager/grad_norm: removed", "  graph/loss: removed", "  graph/grad_norm: removed"} <= set(lines)
    assert "  eager/loss: unchanged (5 steps)" in diff_summary(old, make()).splitlines()
    fingerprinted = diff_summary(old, make(provenance={**PROVENANCE, "mkl": "2024.2 build 20240605", "cuda": None}))
    assert {"  provenance.mkl: unknown -> 2024.2 build 20240605", "  provenance.cuda: unknown -> null"} <= set(
        fingerprinted.splitlines()
    )


# --- planning: which golden a run compares with, and how -------------------------------------

NATIVE = "cpu-native-avx512-gloo-float32-torch2.13"
PINNED = "cpu-pinned-avx2-gloo-float32-torch2.13"


def _record(golden_dir, key, config=CONFIG, metrics=None):
    path = golden_dir / "parity" / f"{key}.json"
    write_golden(path, make(metrics, key=key, config=config))
    return path


def test_own_golden_is_checked_at_its_own_tier(tmp_path):
    path = _record(tmp_path, PINNED)
    plan = plan_golden("parity", CONFIG, PINNED, "auto", tmp_path, CROSS_ENV)
    assert (plan.mode, plan.path, plan.tier, plan.cross_env) == ("check", path, {"kind": "exact"}, False)
    assert not plan.missing
    assert plan.summary(None)["compared_env_key"] == PINNED
    assert plan.note == f"golden: will compare with parity/{PINNED}.json, bitwise identical"


def test_the_golden_outcome_counts_the_checks_that_match_and_differ(tmp_path):
    _record(tmp_path, PINNED)
    plan = plan_golden("parity", CONFIG, PINNED, "check", tmp_path, CROSS_ENV)
    assert plan.outcome(golden_checks(plan, {"eager": frame(), "graph": frame()}, steps=5)) == (
        f"golden: 4 of 4 checks match parity/{PINNED}.json (bitwise identical)"
    )
    changed = frame()
    changed.loc[3, "grad_norm"] += 1e-9
    results = golden_checks(plan, {"eager": changed, "graph": changed}, steps=5)
    assert plan.outcome(results) == f"golden: 2 of 4 checks differ from parity/{PINNED}.json (bitwise identical)"
    off = plan_golden("parity", CONFIG, PINNED, "off", tmp_path, CROSS_ENV)
    assert off.outcome(results) is None  # nothing was compared: the plan's note says why


def test_golden_paths_are_shown_relative_to_the_checkout_or_the_golden_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = SOURCE_ROOT / "golden" / "parity" / f"{PINNED}.json"
    assert shown_path(shipped, SOURCE_ROOT / "golden") == f"golden/parity/{PINNED}.json"
    elsewhere = tmp_path.parent / "goldens"
    assert shown_path(elsewhere / "parity" / "k.json", elsewhere) == "parity/k.json"
    assert shown_path(tmp_path / "g" / "parity" / "k.json", tmp_path.parent) == "g/parity/k.json"  # the cwd first


def test_golden_of_another_environment_is_checked_at_the_cross_env_tier(tmp_path):
    other = _record(tmp_path, NATIVE)
    _record(tmp_path, "cuda-h200-nccl-float32-torch2.13")  # another device family: never compared
    for requested in ("auto", "check"):
        plan = plan_golden("parity", CONFIG, PINNED, requested, tmp_path, CROSS_ENV)
        assert plan.mode == "check" and plan.cross_env and plan.tier == CROSS_ENV
        assert plan.missing and plan.note == (
            f"golden: this environment's golden ({PINNED}) is missing; will compare loosely with {NATIVE}"
            f" at the cross-environment tier: parity/{other.name}, within rtol=0.0001 atol=0"
        )
    drifted = frame()
    drifted.loc[2, "loss"] *= 1 + 1e-6  # kernel-ISA noise: within the tier
    results = golden_checks(plan, {"eager": drifted, "graph": frame()}, steps=5)
    assert all(r.status == "pass" for r in results)
    assert results[0].detail.startswith(f"cross-environment vs {NATIVE}: 5 steps within rtol=0.0001")
    assert plan.outcome(results) == (
        f"golden: this environment's golden ({PINNED}) is missing; compared loosely with {NATIVE}"
        f" at the cross-environment tier: 4 of 4 checks match parity/{other.name} (within rtol=0.0001 atol=0)"
    )
    summary = plan.summary(plan.outcome(results))
    assert (summary["missing_for_this_environment"], summary["compared_env_key"]) == (True, NATIVE)
    assert GoldenPlan.from_record(plan.record).missing  # harness collect says it too
    drifted.loc[3, "loss"] *= 1 + 1e-3  # a real change: caught
    failed = [r for r in golden_checks(plan, {"eager": drifted, "graph": frame()}, steps=5) if r.status == "fail"]
    assert [r.name for r in failed] == ["golden:eager:loss"] and failed[0].first_divergent_step == 3


def test_comparable_env_keys_prefer_same_torch_then_pinned(tmp_path):
    for key in ("cpu-native-avx2-gloo-float32-torch2.12", NATIVE, "cpu-pinned-avx2-gloo-float32-torch2.12",
                "cpu-native-avx2-gloo-bfloat16-torch2.13", "cpu-native-avx2-nccl-float32-torch2.13"):  # fmt: skip
        _record(tmp_path, key)
    recorded = [p.stem for p in (tmp_path / "parity").iterdir()]
    found = comparable_env_keys("cpu-pinned-avx2-gloo-float32-torch2.13", recorded)
    assert found == [NATIVE, "cpu-pinned-avx2-gloo-float32-torch2.12", "cpu-native-avx2-gloo-float32-torch2.12"]


def test_an_update_diffs_against_the_golden_it_replaces_as_read_when_it_writes(tmp_path):
    """The golden an update replaces is read when the update writes, not when the run was planned
    (``harness collect`` plans nothing): the diff is against the file being replaced, one written
    meanwhile included, and an unreadable one is said, then replaced."""
    suite = load_suite("parity")
    plan = plan_golden(suite.name, golden_config(suite), PINNED, "update", tmp_path, CROSS_ENV)
    manifest = Manifest(
        command=["harness", "golden", "update", "parity"], created="2026-01-01T00:00:00Z", suite=suite.to_dict(),
        versions={"torch": "2.13.0+cpu", "harness": "0.1.0", "git_sha": "abc123"}, device="cpu",
        device_class="cpu-pinned-avx2", cpu_isa=None, backend="gloo", ranks=2, seed=[0], env_key=PINNED,
        golden_config=golden_config(suite), launches=[], golden=plan.record, timeout_s=60.0, trace_cache=None,
    )  # fmt: skip
    metrics = {arm: frame() for arm in suite.arms}
    plan.path.parent.mkdir(parents=True)
    plan.path.write_text("{not json")
    news = update_golden(plan, suite, manifest, metrics).splitlines()
    assert news[0].startswith(f"replacing an unreadable golden: {plan.path}: ")
    assert news[1] == f"golden parity/{PINNED}: new file" and news[-1] == f"wrote parity/{PINNED}.json"
    moved = {arm: frame() for arm in suite.arms}
    moved["eager"].loc[3, "loss"] += 1e-9
    news = update_golden(plan, suite, manifest, moved).splitlines()
    assert news[0] == f"golden parity/{PINNED}: update"
    assert "  eager/loss: changed: first divergence at step 3:" in "\n".join(news)
    assert "  graph/loss: unchanged (5 steps)" in news
    assert load_golden(plan.path).arms["eager"]["loss"].equals(moved["eager"]["loss"])
    # A calibration measures the noise between environments, not this one's values: an update keeps it.
    calibrated = json.loads(plan.path.read_text())
    calibrated["provenance"]["calibration"] = {"noise": {"loss": 1e-7}, "margin": 10.0, "measured": ["a vs b"]}
    plan.path.write_text(json.dumps(calibrated))
    update_golden(plan, suite, manifest, metrics)
    assert load_golden(plan.path).provenance["calibration"] == calibrated["provenance"]["calibration"]


def test_no_golden_is_an_error_under_check_and_a_stated_skip_under_auto(tmp_path):
    _record(tmp_path, "cpu-native-avx2-gloo-bfloat16-torch2.13")
    with pytest.raises(GoldenError) as exc:
        plan_golden("parity", CONFIG, PINNED, "check", tmp_path, CROSS_ENV)
    assert f"no golden for env key {PINNED}" in str(exc.value) and "harness golden update parity" in str(exc.value)
    plan = plan_golden("parity", CONFIG, PINNED, "auto", tmp_path, CROSS_ENV)
    assert plan.mode == "off"
    assert plan.note == (
        f"golden: not compared: no golden for env key {PINNED} in parity"
        " (recorded: cpu-native-avx2-gloo-bfloat16-torch2.13; none comparable)"
    )


def test_golden_of_another_configuration_names_the_fields(tmp_path):
    path = _record(tmp_path, PINNED)
    other = {"steps": 5, "arms": {"eager": {"ranks": 4, "config": {"chunks": 4}}, "graph": {"ranks": 4, "config": {}}}}
    with pytest.raises(GoldenError) as exc:
        plan_golden("parity", other, PINNED, "check", tmp_path, CROSS_ENV)
    assert str(exc.value) == (
        f"{path}: config: recorded for another configuration: arms.eager.config.chunks: golden 2, this run 4;"
        " arms.eager.ranks: golden 2, this run 4; arms.graph.ranks: golden 2, this run 4"
    )
    plan = plan_golden("parity", other, PINNED, "auto", tmp_path, CROSS_ENV)
    assert plan.mode == "off" and "arms.eager.config.chunks: golden 2, this run 4" in plan.note


def test_steps_are_part_of_a_goldens_identity(tmp_path):
    _record(tmp_path, PINNED)
    longer = {**CONFIG, "steps": 20}
    with pytest.raises(GoldenError, match=r"steps: golden 5, this run 20 \(longer than its golden\)"):
        plan_golden("parity", longer, PINNED, "check", tmp_path, CROSS_ENV)
    shorter = plan_golden("parity", {**CONFIG, "steps": 3}, PINNED, "check", tmp_path, CROSS_ENV)
    assert shorter.mode == "check" and ", its first 3 of 5 steps," in shorter.note
    first = frame().loc[:3]  # these frames count steps from 0; a run's from 1
    results = golden_checks(shorter, {"eager": first, "graph": first}, steps=3)
    assert all(r.status == "pass" and r.detail.startswith("4 steps") for r in results)


def test_config_differences_see_through_tuples_and_name_missing_fields():
    assert config_differences({"a": {"b": [1, 2]}}, {"a": {"b": (1, 2)}}) == []
    assert config_differences({"a": {"b": 1}}, {"a": {"c": 1}}) == [
        "a.b: golden 1, this run unset",
        "a.c: golden unset, this run 1",
    ]


# --- drift or regression: a golden that fails bitwise, judged again --------------------------

NIGHTLY = "2.13.0.dev20261120+cpu"
# A stated environment: this run's, and (with a field changed) the one a golden was recorded in.
RUN_ENV = {
    "device": "cpu", "cpu_isa": "avx2", "gpu": None, "driver": None, "torch": "2.13.0+cpu", "cuda": None,
    "cudnn": None, "nccl": None, "mkl": "2024.2 build 20240605", "onednn": "3.12.0", "python": "3.11.7",
}  # fmt: skip


def _judged(golden_dir, recorded_env, rel):
    """The golden checks of a run in RUN_ENV whose eager loss is ``rel`` off a golden recorded in
    ``recorded_env`` (PROVENANCE alone: a golden from before the fingerprint)."""
    write_golden(golden_dir / "parity" / f"{PINNED}.json", make(key=PINNED, provenance={**PROVENANCE, **recorded_env}))
    plan = plan_golden("parity", CONFIG, PINNED, "check", golden_dir, CROSS_ENV, RUN_ENV)
    moved = frame()
    moved["loss"] *= 1 + rel
    results = golden_checks(plan, {"eager": moved, "graph": frame()}, steps=5, cross_env_tier=CROSS_ENV)
    assert all(r.label is None for r in results if r.status == "pass")
    [failed] = [r for r in results if r.status == "fail"]
    assert failed.name == "golden:eager:loss" and failed.detail.startswith("first divergence at step 0")
    return failed


def test_a_bitwise_failure_within_the_cross_env_tier_in_another_environment_is_drift(tmp_path):
    drift = _judged(tmp_path, {**RUN_ENV, "torch": NIGHTLY}, rel=1e-7)
    assert drift.label == "drift"
    assert f"; torch {NIGHTLY} -> 2.13.0+cpu; passes the cross-environment tier: 5 steps within rtol=0.0001" in (
        drift.detail
    )
    assert drift.extra["environment"] == {"changed": [f"torch {NIGHTLY} -> 2.13.0+cpu"], "unrecorded": []}
    assert drift.extra["cross_env"]["status"] == "pass"
    recorded = plan_golden("parity", CONFIG, PINNED, "check", tmp_path, CROSS_ENV, RUN_ENV).record
    assert GoldenPlan.from_record(json.loads(json.dumps(recorded))).fingerprint == RUN_ENV  # harness collect's


@pytest.mark.parametrize(
    ("recorded", "rel", "why"),
    [
        ({**RUN_ENV, "torch": NIGHTLY}, 1e-3, "; fails the cross-environment tier too: first divergence at step 0"),
        (RUN_ENV, 1e-7, "; the environment is the golden's: the code moved it, within the cross-environment tier"),
        ({}, 1e-7, "; the environment is the golden's (the golden does not record: cpu_isa unknown -> avx2, gpu "),
    ],
    ids=["far-off-in-another-environment", "near-in-the-same-environment", "near-under-a-golden-without-fingerprint"],
)
def test_a_bitwise_failure_is_a_regression_unless_it_is_drift(tmp_path, recorded, rel, why):
    regression = _judged(tmp_path, recorded, rel)
    assert regression.label == "regression" and why in regression.detail


def test_a_shipped_golden_predates_the_fingerprint_loads_and_names_its_unknown_fields_as_no_change():
    path = SOURCE_ROOT / "golden" / "parity" / "cpu-pinned-avx2-amd-gloo-float32-torch2.13.json"
    shipped = load_golden(path).provenance
    assert "mkl" not in shipped
    same = {**RUN_ENV, "device": shipped["device"], "torch": shipped["torch"]}
    changed, unrecorded = fingerprint_changes(shipped, same)
    assert changed == [] and unrecorded == [
        "cpu_isa unknown -> avx2", "gpu unknown -> null", "driver unknown -> null", "cuda unknown -> null",
        "cudnn unknown -> null", "nccl unknown -> null", "mkl unknown -> 2024.2 build 20240605",
        "onednn unknown -> 3.12.0", "python unknown -> 3.11.7",
    ]  # fmt: skip
    changed, _ = fingerprint_changes(shipped, {**same, "device": "cpu-pinned-avx2-intel"})
    assert changed == ["device cpu-pinned-avx2-amd -> cpu-pinned-avx2-intel"]


@pytest.mark.parametrize(
    ("command", "rebless"),
    [
        (
            "harness run parity --steps 3 --golden check --out /tmp/r --set arms.eager.lr=-1 --verbose",
            "harness golden update parity --steps 3 --set arms.eager.lr=-1 --verbose",
        ),
        (
            f"harness ci determinism {SOURCE_ROOT}/suites/parity.toml --retries=2 --golden-dir /g --cpu-isa native",
            f"harness golden update {SOURCE_ROOT}/suites/parity.toml --golden-dir /g --cpu-isa native",
        ),
        (
            "harness submit parity --nodes 2 --partition gpu --no-wait --device cuda --ranks 4",
            "harness golden update parity --device cuda --ranks 4",
        ),
    ],
    ids=["run", "gate", "slurm"],
)
def test_the_rebless_command_is_the_runs_own_as_a_golden_update(command, rebless):
    assert rebless_command(command.split(), load_suite("parity")) == rebless
