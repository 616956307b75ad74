"""`harness run` end to end on real gloo ranks: each exit code and failure path, for real."""

from __future__ import annotations

import json
import shlex
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.environment import cpu_pin, run_env_key
from harness.golden import PROVENANCE_KEYS
from harness.records import read_jsonl, read_metrics

CPU_KEY = run_env_key("cpu", "float32")
NIGHTLY = "2.13.0.dev20261120+cpu"  # a stated torch that recorded a golden: not this run's
HANG_TIMEOUT_S = 25


def test_two_runs_at_once_both_pass(start_harness, tmp_path: Path) -> None:
    runs = {
        "logical-ranks": start_harness("run", "logical-ranks", "--steps", 3, "--out", tmp_path / "logical-ranks"),
        "determinism": start_harness("run", "determinism", "--steps", 3, "--out", tmp_path / "determinism"),
    }
    for suite, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{suite}:\n{stdout}\n{stderr}"
        run_dir = tmp_path / suite
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["verdict"] == "pass" and summary["exit_code"] == 0
        for arm in summary["arms"]:
            assert [r["step"] for r in read_jsonl(run_dir / "arms" / arm / "metrics.jsonl")] == [1, 2, 3]
        assert {"report.html", "junit.xml", "manifest.json"} <= {p.name for p in run_dir.iterdir()}
        assert f"run dir: {run_dir}" in stdout
    assert (tmp_path / "logical-ranks" / "logs" / "procs" / "rank1.log").is_file()
    assert (tmp_path / "determinism" / "logs" / "rank1.log").is_file()


def test_perturbed_arm_exits_1_naming_the_first_divergent_step(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 3, "--set", "arms.inproc.lr=0.01", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr
    loss = run.check(out, "procs vs inproc: loss")
    # Step 1's loss is computed before the first update, so a learning rate shows from step 2.
    assert loss["status"] == "fail" and loss["first_divergent_step"] == 2
    assert set(loss["values"]) == {"procs", "inproc"}
    assert "first divergence at step 2" in run.stdout
    assert run.summary(out)["verdict"] == "fail"

    (out / "report.html").unlink()
    rerendered = run_harness("report", out)
    assert rerendered.returncode == 0, rerendered.stderr
    assert (out / "report.html").is_file() and "FAIL" in rerendered.stdout


def test_rank_that_raises_exits_3_and_shows_its_traceback(run_harness, processes_mentioning, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "logical-ranks", "--steps", 3, "--out", out, "--set", "debug.fail_step=2", "--set", "debug.fail_rank=1"
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert "rank 1 of group 'procs' failed first" in run.stderr
    assert "raised outside the system under test" in run.stderr  # the injection is the harness's own code
    assert "Traceback (most recent call last)" in run.stderr
    assert "RuntimeError: injected failure" in run.stderr
    summary = run.summary(out)
    assert summary["verdict"] == "error" and summary["exit_code"] == 3
    assert summary["arms"]["procs"]["steps_completed"] == 1  # the finished step stays on disk
    assert run.check(out, "launch: procs")["status"] == "error"
    assert not processes_mentioning(str(out))
    # The phases up to the failure stay on disk too, the failed one marked, and the timeline uses them.
    phases = [json.loads(line) for line in (out / "phases" / "procs.rank1.jsonl").read_text().splitlines()]
    assert [p["phase"] for p in phases] == ["imports", "rendezvous", "build", "steps"]
    assert phases[-1]["detail"] == {"steps": 1, "failed": True}
    segments = [(s["segment"], s["arm"]) for s in summary["timing"]["timeline"] if s["group"] == "procs"]
    assert segments == [(n, None) for n in ("start processes", "imports", "rendezvous")] + [
        ("build", "procs"),
        ("steps", "procs"),
        ("exit", None),
    ]


def test_sigkilled_rank_is_named_as_the_root_cause_not_its_survivor(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "logical-ranks", "--steps", 3, "--out", out,
        "--set", "debug.fail_step=2", "--set", "debug.fail_rank=1", "--set", "debug.fail_mode=kill",
    )  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr
    assert "rank 1 of group 'procs' failed first (killed by SIGKILL" in run.stderr, run.stderr
    assert "then, as a consequence: rank 0" in run.stderr
    root = run.summary(out)["launches"][0]["root_cause"]
    assert root == {"kind": "infrastructure", "reason": "killed by SIGKILL", "rank": 1}


SUBJECT_BUG = """
import harness.reference.model as model


def broken_norm(self, x):
    raise RuntimeError("shape '[4, 32, 64]' is invalid for input of size 4000")


model.RMSNorm.forward = broken_norm
"""


def test_rank_raising_in_the_system_under_test_is_a_regression(run_harness, plant, tmp_path: Path) -> None:
    """A shape error a change put into the reference fails the same way on every retry: exit 1."""
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 2, "--out", out, env=plant(SUBJECT_BUG))
    assert run.returncode == 1, run.stdout + run.stderr
    raised = [c for c in run.summary(out)["checks"] if c["kind"] == "rank-raised"]
    assert len(raised) == 1 and raised[0]["status"] == "fail", raised
    assert "raised in the system under test (model.py)" in raised[0]["detail"]
    assert "is invalid for input of size 4000" in raised[0]["extra"]["traceback"]
    assert run.summary(out)["verdict"] == "fail"


def test_arm_that_stops_short_without_a_crash_fails(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run",
        "logical-ranks",
        "--steps",
        3,
        "--out",
        out,
        "--set",
        "debug.fail_step=2",
        "--set",
        "debug.fail_mode=stop",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    short = run.check(out, "records: procs")
    assert short["status"] == "fail" and short["detail"] == "arm 'procs' recorded 1 of 3 steps, and no rank failed"
    assert run.check(out, "procs vs inproc: loss")["status"] == "fail"  # the checks still ran, on 1 step


def test_rank_that_hangs_is_dumped_and_killed_at_the_timeout(run_harness, processes_mentioning, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "logical-ranks", "--steps", 3, "--out", out, "--timeout", HANG_TIMEOUT_S,
        "--set", "debug.fail_step=2", "--set", "debug.fail_rank=1", "--set", "debug.fail_mode=hang",
    )  # fmt: skip
    assert run.returncode == 3, run.stdout + run.stderr
    summary = run.summary(out)
    assert summary["launches"][0]["timed_out"]
    assert summary["launches"][0]["root_cause"] == {"kind": "infrastructure", "reason": "timeout", "rank": None}
    assert "ranks [0, 1]: Python stacks dumped to logs/procs/rank<k>.log" in summary["launches"][0]["error"]
    assert summary["duration_s"] < HANG_TIMEOUT_S + 5
    assert run.elapsed_s < HANG_TIMEOUT_S + 20  # + interpreter start-up, report writing
    logs = {k: (out / "logs" / "procs" / f"rank{k}.log").read_text() for k in (0, 1)}
    assert all("(most recent call first)" in log for log in logs.values()), logs
    assert "harness/rank/faults.py" in logs[1]  # the hung rank's stack shows where it hangs
    assert not processes_mentioning(str(out))


BAD_SUITE = """
name = "bad"
description = "a suite with a wrong type"
ranks = 2
steps = 3
[arms.eager]
chunking = "eager"
chunks = "two"
"""


def test_bad_suite_exits_2_naming_file_and_field(harness_main, tmp_path: Path) -> None:
    suite = tmp_path / "bad.toml"
    suite.write_text(BAD_SUITE)
    run = harness_main("run", suite, "--out", tmp_path / "run")
    assert run.returncode == 2
    assert f'{suite}: arms.eager.chunks: expected int >= 1, got "two"' in run.stderr
    assert not (tmp_path / "run").exists()


def test_bad_set_exits_2_naming_the_override(harness_main, tmp_path: Path) -> None:
    run = harness_main("run", "logical-ranks", "--set", "arms.procs.chunks=two", "--out", tmp_path / "run")
    assert run.returncode == 2
    assert '--set arms.procs.chunks: expected int >= 1, got "two"' in run.stderr
    assert not (tmp_path / "run").exists()


def _golden_of(suite: str) -> str:
    trajectory = {"start_step": 1, "end_step": 1, "values": {"1": 1.0}}
    return json.dumps({
        "schema": 2, "suite": suite, "env_key": CPU_KEY, "provenance": dict.fromkeys(PROVENANCE_KEYS, "x"),
        "config": {"steps": 1, "arms": {}}, "tier": {"kind": "exact"}, "arms": {"first": {"loss": trajectory}},
    })  # fmt: skip


@pytest.mark.parametrize(
    "content,message",
    [("{not json", "invalid JSON"), (_golden_of("logical-ranks"), "golden is for suite 'logical-ranks'")],
    ids=["corrupt", "other-suite"],
)
def test_corrupt_or_mismatched_golden_exits_2_naming_the_file(
    harness_main, tmp_path: Path, content: str, message: str
) -> None:
    golden = tmp_path / "golden" / "determinism" / f"{CPU_KEY}.json"
    golden.parent.mkdir(parents=True)
    golden.write_text(content)
    run = harness_main("run", "determinism", "--golden-dir", tmp_path / "golden", "--out", tmp_path / "run")
    assert run.returncode == 2, run.stdout + run.stderr
    assert str(golden) in run.stderr and message in run.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def determinism_golden(module_run_harness, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """``harness golden update determinism --ranks 1 --steps 2`` into an empty golden root: the update
    and the root, which the golden tests below copy and change."""
    folder = tmp_path_factory.mktemp("determinism-golden")
    args = ("determinism", "--ranks", 1, "--steps", 2, "--golden-dir", folder / "golden", "--out", folder / "update")
    return module_run_harness("golden", "update", *args), folder / "golden"


def test_golden_update_then_a_moved_golden_fails_as_a_regression_or_as_drift(
    run_harness, determinism_golden: tuple, tmp_path: Path
) -> None:
    """The golden moves by 1e-9 at one step: in the golden's own environment that is the code (a
    regression); under a golden that says another torch recorded it, drift, whose re-bless command
    records the golden again and prints the diff."""
    update, recorded = determinism_golden
    assert update.returncode == 0, update.stdout + update.stderr
    shutil.copytree(recorded, tmp_path / "golden")
    common = ("determinism", "--ranks", 1, "--steps", 2, "--golden-dir", tmp_path / "golden")
    golden = tmp_path / "golden" / "determinism" / f"{CPU_KEY}.json"
    assert "golden determinism/" in update.stdout and "new file" in update.stdout
    assert update.stdout.splitlines()[-2] == f"wrote determinism/{CPU_KEY}.json"

    data = json.loads(golden.read_text())
    assert data["provenance"]["torch"] == torch.__version__ and "onednn" in data["provenance"]  # the fingerprint
    data["arms"]["first"]["loss"]["values"]["2"] += 1e-9
    golden.write_text(json.dumps(data))
    check = run_harness("run", *common, "--out", tmp_path / "check")
    assert check.returncode == 1, check.stdout + check.stderr
    moved = check.check(tmp_path / "check", "golden:first:loss")
    assert moved["status"] == "fail" and moved["first_divergent_step"] == 2 and moved["label"] == "regression"
    assert moved["detail"].endswith(
        "; the environment is the golden's: the code moved it, within the cross-environment tier"
    )
    assert check.check(tmp_path / "check", "golden:second:loss")["status"] == "pass"
    # The plan is announced before the run, the outcome after judging; both name the golden relatively.
    lines = check.stdout.splitlines()
    plan = f"golden: will compare with determinism/{CPU_KEY}.json, bitwise identical"
    outcome = f"golden: 1 of 4 checks differ from determinism/{CPU_KEY}.json (bitwise identical)"
    assert plan in lines and outcome in lines and lines.index(plan) < lines.index(outcome)
    assert lines[lines.index(outcome) - 1].startswith("0 passed") is False
    assert lines[-2].startswith("run dir: ") and lines[-1] == "regression: 1 failed check: golden:first:loss"
    summary = check.summary(tmp_path / "check")
    assert f"determinism: FAIL [regression] (exit 1) - {len(summary['checks'])} checks" in check.stdout
    assert (summary["golden"]["plan"], summary["golden"]["outcome"]) == (plan, outcome)
    assert summary["golden"]["compared"] == f"determinism/{CPU_KEY}.json"
    assert summary["golden"]["compared_env_key"] == CPU_KEY and not summary["golden"]["missing_for_this_environment"]
    assert str(tmp_path) not in json.dumps(summary["golden"])
    assert (summary["label"], summary["label_line"]) == ("regression", lines[-1])

    data["provenance"]["torch"] = NIGHTLY
    golden.write_text(json.dumps(data))
    drift = run_harness("run", *common, "--out", tmp_path / "drift")
    assert drift.returncode == 1, drift.stdout + drift.stderr  # CI must not merge on drift silently
    moved = drift.check(tmp_path / "drift", "golden:first:loss")
    assert (
        moved["label"] == "drift" and f"; torch {NIGHTLY} -> {torch.__version__}; passes the cross" in moved["detail"]
    )
    rebless = f"harness golden update determinism --ranks 1 --steps 2 --golden-dir {tmp_path / 'golden'}"
    last = f"drift: re-bless: torch {NIGHTLY} -> {torch.__version__} moved 1 golden check, within the"
    last += f" cross-environment tier; review the new golden: {rebless}"
    assert drift.stdout.splitlines()[-1] == last and drift.summary(tmp_path / "drift")["label"] == "drift"
    assert "DRIFT  golden:first:loss" in drift.stdout
    testsuite = ET.parse(tmp_path / "drift" / "junit.xml").getroot().find("testsuite")
    assert testsuite.find("properties/property[@name='label']").get("value") == "drift"
    assert testsuite.find("testcase[@name='golden:first:loss']/failure").get("message").startswith("drift: ")
    assert "determinism: FAIL [drift: re-bless]" in (tmp_path / "drift" / "report.html").read_text()

    blessed = run_harness(*shlex.split(rebless)[1:], "--out", tmp_path / "rebless")
    assert blessed.returncode == 0, blessed.stdout + blessed.stderr
    assert f"  provenance.torch: {NIGHTLY} -> {torch.__version__}" in blessed.stdout.splitlines()
    assert "  first/loss: changed: first divergence at step 2:" in blessed.stdout


def test_another_isas_golden_is_compared_loosely_then_at_its_calibrated_tier(
    run_harness, harness_main, tmp_path: Path
) -> None:
    goldens = ("--golden-dir", tmp_path / "golden")
    common = ("logical-ranks", "--steps", 3, *goldens)
    native = run_harness("golden", "update", *common, "--cpu-isa", "native", "--out", tmp_path / "native")
    assert native.returncode == 0, native.stdout + native.stderr
    [recorded] = (tmp_path / "golden" / "logical-ranks").iterdir()
    assert recorded.name.startswith("cpu-native-") and recorded.stem != CPU_KEY

    doctor = harness_main("doctor", *goldens)
    assert f"env key cpu    {CPU_KEY}" in doctor.stdout and "goldens cpu    none in" in doctor.stdout

    out = tmp_path / "pinned"
    run = run_harness("run", *common, "--golden", "check", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    missing = f"golden: this environment's golden ({CPU_KEY}) is missing; "
    loosely = f"loosely with {recorded.stem} at the cross-environment tier: "
    plan = f"{missing}will compare {loosely}logical-ranks/{recorded.name}, within rtol=0.0001 atol=0"
    outcome = f"{missing}compared {loosely}4 of 4 checks match logical-ranks/{recorded.name}"
    outcome += " (within rtol=0.0001 atol=0)"
    assert plan in run.stdout.splitlines() and outcome in run.stdout.splitlines()
    loss = run.check(out, "golden:procs:loss")
    assert loss["status"] == "pass" and loss["detail"].startswith(f"cross-environment vs {recorded.stem}: 3 steps")
    golden = run.summary(out)["golden"]
    assert (golden["plan"], golden["outcome"]) == (plan, outcome)
    assert (golden["missing_for_this_environment"], golden["compared_env_key"]) == (True, recorded.stem)
    arm = json.loads((out / "arms" / "procs" / "arm.json").read_text())
    assert arm["cpu_capability"] == "avx2"  # the pin reached the ranks
    assert json.loads((out / "manifest.json").read_text())["cpu_isa"]["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    _calibrated_then_a_change_at_three_times_the_tier_fails(run_harness, common, recorded, tmp_path)


def _calibrated_then_a_change_at_three_times_the_tier_fails(run_harness, common: tuple, golden: Path, tmp_path: Path):
    """``harness golden calibrate``: the pinned and the native run measure the ISA noise, which goes into the
    golden's provenance; the pinned run then compares at ten times it, and a golden moved by three times
    that tier fails, where the fixed tier (rtol 1e-4) passed it."""
    native = cpu_pin("native").capability
    calibrate = run_harness("golden", "calibrate", *common, "--out", tmp_path / "calibrate")
    assert calibrate.returncode == 0, calibrate.stdout + calibrate.stderr
    if native == "avx2":  # one ISA: the pinned run and the native golden agree, and the tier says it is exact
        assert "warning: nothing moved between these environments: the tier is exact" in calibrate.stdout
        assert set(json.loads(golden.read_text())["provenance"]["calibration"]["noise"].values()) == {0.0}
        return
    noise = json.loads(golden.read_text())["provenance"]["calibration"]["noise"]
    runs = {isa: tmp_path / "calibrate" / isa / "arms" for isa in ("avx2", native)}
    apart = {  # what the two runs recorded, measured here by hand
        metric: max(
            float((abs(a - b) / pd.concat([abs(a), abs(b)], axis=1).min(axis=1)).max())
            for arm in ("procs", "inproc")
            for a, b in [[read_metrics(runs[isa] / arm / "metrics.jsonl")[metric] for isa in runs]]
        )
        for metric in ("loss", "grad_norm")
    }
    largest = max(apart.values())  # a metric that did not move takes the largest
    assert largest > 0 and noise == pytest.approx({m: value or largest for m, value in apart.items()}, rel=1e-9)
    for metric, value in noise.items():
        assert (
            f"{metric}: noise {value:.3g}" in calibrate.stdout
            and f"tier rtol={10 * value:.3g} (10x)" in calibrate.stdout
        )
    out = tmp_path / "calibrated"
    run = run_harness("run", *common, "--golden", "check", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    how = f"calibrated: loss within rtol={10 * noise['loss']:.2g}, grad_norm within rtol={10 * noise['grad_norm']:.2g}"
    assert f"{golden.name}, {how} (10x the noise measured)" in run.stdout
    moved = json.loads(golden.read_text())
    assert 3 * 10 * noise["loss"] < 1e-4  # inside the fixed tier
    for step, value in moved["arms"]["procs"]["loss"]["values"].items():
        moved["arms"]["procs"]["loss"]["values"][step] = value * (1 + 3 * 10 * noise["loss"])
    golden.write_text(json.dumps(moved))
    out = tmp_path / "moved"
    run = run_harness("run", *common, "--golden", "check", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.check(out, "golden:procs:loss")["status"] == "fail"
    assert run.check(out, "golden:procs:grad_norm")["status"] == "pass"


def test_golden_of_another_configuration_is_exit_2_under_check(
    run_harness, harness_main, determinism_golden: tuple, tmp_path: Path
) -> None:
    update, recorded = determinism_golden
    assert update.returncode == 0, update.stdout + update.stderr
    shutil.copytree(recorded, tmp_path / "golden")
    goldens = ("--golden-dir", tmp_path / "golden")
    golden = tmp_path / "golden" / "determinism" / f"{CPU_KEY}.json"
    longer = harness_main(
        "run", "determinism", "--ranks", 1, "--steps", 3, "--golden", "check", *goldens, "--out", tmp_path / "r"
    )
    assert longer.returncode == 2, longer.stdout + longer.stderr
    assert longer.stderr == (
        f"error: {golden}: config: recorded for another configuration:"
        " steps: golden 2, this run 3 (longer than its golden)\n"
    )
    auto = run_harness("run", "determinism", "--ranks", 1, "--steps", 3, *goldens, "--out", tmp_path / "a")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    skipped = auto.check(tmp_path / "a", "golden")
    assert skipped["status"] == "skip" and "steps: golden 2, this run 3" in skipped["detail"]
    assert "1 skipped" in auto.stdout
    assert f"golden: not compared: determinism/{golden.name} is for another configuration" in auto.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("--out", "{tmp}/file/run"),
            "error: --out {tmp}/file/run: cannot create the run directory: Not a directory\n",
        ),
        (("--timeout", "inf"), "error: --timeout: expected a finite number of seconds > 0, got inf\n"),
        (("--set", "checks=[]"), "error: --set checks: expected at least one [[checks]] table, got []\n"),
        (("--trace-cache", "{tmp}/file"), "error: --trace-cache {tmp}/file: exists and is not a directory\n"),
        (("--trace-cache", ""), "error: --trace-cache: expected a directory or off, got an empty value\n"),
    ],
    ids=["unwritable-out", "infinite-timeout", "no-checks", "trace-cache-file", "trace-cache-empty"],
)
def test_bad_usage_exits_2_with_one_line(harness_main, tmp_path: Path, args: tuple, message: str) -> None:
    (tmp_path / "file").write_text("")
    run = harness_main("run", "logical-ranks", *(a.format(tmp=tmp_path) for a in args))
    assert (run.returncode, run.stderr) == (2, message.format(tmp=tmp_path))


def test_trace_cache_from_the_environment_is_checked_and_named(harness_main, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    run = harness_main("run", "logical-ranks", env={"HARNESS_TRACE_CACHE": tmp_path / "file"})
    assert (run.returncode, run.stderr) == (
        2,
        f"error: HARNESS_TRACE_CACHE {tmp_path}/file: exists and is not a directory\n",
    )


def test_timeout_while_ranks_start_says_no_stack_was_dumped(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "logical-ranks", "--steps", 3, "--timeout", 1, "--out", out)
    assert run.returncode == 3, run.stdout + run.stderr
    error = run.summary(out)["launches"][0]["error"]
    assert "ranks [0, 1]: no stack (still starting up, before the dump handler)" in error
    assert "stacks dumped" not in error


HARNESS_BUG = """
import harness.judge


def broken_check(check, suite, records):
    raise TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")


harness.judge.run_check = broken_check
"""


def test_error_inside_the_harness_is_exit_3_with_one_line_and_a_logged_traceback(
    run_harness, plant, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    planted = plant(HARNESS_BUG)
    run = run_harness("run", "determinism", "--ranks", 1, "--steps", 1, "--out", out, env=planted, process=True)
    assert run.returncode == 3, run.stdout + run.stderr
    summary = run.summary(out)
    assert summary["verdict"] == "error" and summary["checks"][0]["kind"] == "internal-error"
    assert "Traceback (most recent call last)" in (out / "logs" / "harness.log").read_text()
    assert "Traceback" not in run.stdout + run.stderr
    assert (out / "junit.xml").is_file() and (out / "report.html").is_file()


def test_error_before_the_run_directory_exists_names_its_traceback_file(run_harness, plant) -> None:
    bug = "import harness.suites\n\ndef broken(*args, **kwargs):\n    raise KeyError('model')\n\n"
    bug += "harness.suites.load_suite = broken\n"
    run = run_harness("run", "determinism", env=plant(bug), process=True)
    assert run.returncode == 3 and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: internal error: KeyError: 'model' (traceback: ")
    log = Path(run.stderr.rstrip().removesuffix(")").rsplit("traceback: ", 1)[1])
    assert "Traceback (most recent call last)" in log.read_text()
