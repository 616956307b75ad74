"""The versioned-pipeline suites (strict-baseline, retention, strict-vs-stale) through the real CLI,
and the version-protocol checks and suite validation on hand-made inputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from harness.checks.exchange import pipeline_plan
from harness.checks.versioned import check_correction_stats, check_exactly_once, check_staleness_ages
from harness.records import read_jsonl
from harness.subject.protocol import VERSIONED
from harness.suites import SuiteError, load_suite


def _assert_pipeline_records(run_dir: Path, arm: str, steps: int, delay: int) -> list[dict]:
    """Update k applies batch k, at age min(k - 1, delay); returns the records."""
    updates = read_jsonl(run_dir / "arms" / arm / "metrics.jsonl")
    assert [u["step"] for u in updates] == list(range(1, steps + 1))
    assert [u["batches_applied"] for u in updates] == [[k] for k in range(1, steps + 1)]
    assert [u["ages"] for u in updates] == [[min(k, delay)] for k in range(steps)]
    return updates


def _assert_passed_against_golden(run, run_dir: Path) -> list[dict]:
    assert run.returncode == 0, run.stdout + run.stderr
    checks = run.summary(run_dir)["checks"]
    assert {c["status"] for c in checks} <= {"pass", "skip"}
    assert [c for c in checks if c["name"].startswith("golden:")] and all(
        c["status"] == "pass" for c in checks if c["name"].startswith("golden:")
    )
    return checks


@pytest.mark.parametrize("suite,arm,delay", [("strict-baseline", "versioned", 0), ("retention", "replay", 2)])
def test_exact_versioned_suite_passes_against_its_golden(
    run_harness, tmp_path: Path, suite: str, arm: str, delay: int
) -> None:
    goldens = ("--golden-dir", tmp_path / "golden")
    update = run_harness("golden", "update", suite, "--steps", 5, *goldens, "--out", tmp_path / "update")
    assert update.returncode == 0, update.stdout + update.stderr
    out = tmp_path / suite
    run = run_harness("run", suite, "--steps", 5, "--golden", "check", *goldens, "--out", out)
    checks = _assert_passed_against_golden(run, out)
    assert {"exact", "exactly-once", "staleness-ages", "token-exchange-invariants"} <= {c["kind"] for c in checks}
    _assert_pipeline_records(out, arm, 5, delay)


def test_strict_vs_stale_passes_its_band_and_reports_the_correction(run_harness, tmp_path: Path) -> None:
    """Its full 20 steps: the band is calibrated for them (see the suite file)."""
    out = tmp_path / "run"
    run = run_harness("run", "strict-vs-stale", "--golden", "off", "--out", out)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.check(out, "strict vs stale, loss band: loss")["status"] == "pass"
    for name in ("stale vs oracle: loss", "stale vs oracle: grad_norm", "stale vs oracle, final weights"):
        assert run.check(out, name)["status"] == "pass", name  # the pipeline is exactly the delayed oracle
    assert run.check(out, "stale: staleness-ages")["detail"].startswith(
        "ages seen: 0 at step 1, 1 at step 2, 2 at steps 3-20"
    )
    stats = run.check(out, "stale: correction-stats")
    assert stats["status"] == "pass" and stats["detail"].startswith("always: mean weight"), stats
    updates = _assert_pipeline_records(out, "stale", 20, 2)
    assert [row["mean"] for row in stats["extra"]["per_step"]] == [u["correction_mean"] for u in updates]
    assert "strict: correction-stats" not in {c["name"] for c in run.summary(out)["checks"]}  # its correction is off
    counts = run.check(out, "stale: token-exchange:expected-counts")
    assert counts["status"] == "pass" and "(fwd 39, bwd 20)" in counts["detail"]  # 20 + one per stale backward
    binds = run.check(out, "clipped: correction-stats, clip binds")
    assert binds["status"] == "pass" and "at every stale step (min_clipped_frac 0.2)" in binds["detail"], binds
    assert min(row["clipped_frac"] for row in binds["extra"]["per_step"][1:]) >= 0.2


CLIP_NEVER_BINDS = """
import harness.reference.versioned as versioned

weight = versioned.correction_weight
versioned.correction_weight = lambda lp_now, lp_then, clip=5.0: weight(lp_now, lp_then, 50.0)
"""


def test_a_clip_that_ignores_its_setting_fails_the_binding_clip_check(run_harness, plant, tmp_path: Path) -> None:
    """The correction clamps at 50 whatever the arm sets: no weight of these runs reaches 5, so only
    the arm whose clip binds (1.01) can tell: its weights leave [0, 1.01]."""
    out = tmp_path / "run"
    run = run_harness(
        "run", "strict-vs-stale", "--steps", 5, "--golden", "off", "--out", out, env=plant(CLIP_NEVER_BINDS)
    )
    assert run.returncode == 1, run.stdout + run.stderr
    failed = {c["name"] for c in run.summary(out)["checks"] if c["status"] == "fail"}
    assert failed == {"clipped: correction-stats", "clipped: correction-stats, clip binds"}, failed
    detail = run.check(out, "clipped: correction-stats, clip binds")["detail"]
    assert detail.startswith("step 2: correction mean ") and " is outside [0, 1.01]" in detail, detail


def test_perturbed_stale_arm_fails_the_band(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness("run", "strict-vs-stale", "--set", "arms.stale.lr=0.01", "--out", out)
    assert run.returncode == 1, run.stdout + run.stderr
    for name in ("strict vs stale, loss band: loss", "strict vs stale, grad-norm band: grad_norm"):
        band = run.check(out, name)
        assert band["status"] == "fail" and band["first_divergent_step"] is not None, band
    assert run.check(out, "stale: exactly-once")["status"] == "pass"  # a learning rate breaks no protocol


def test_planted_double_apply_is_caught_by_exactly_once(run_harness, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = run_harness(
        "run", "strict-baseline", "--steps", 4, "--set", "arms.versioned.apply_twice_batch=3", "--out", out
    )
    assert run.returncode == 1, run.stdout + run.stderr
    once = run.check(out, "versioned: exactly-once")
    assert once["status"] == "fail" and once["first_divergent_step"] == 3
    assert once["detail"] == "batch 3 applied 2 times, at steps 3, 3"
    assert "versioned: exactly-once" in run.stdout and "batch 3 applied 2 times" in run.stdout


def test_delay_beyond_max_staleness_exits_2_before_launching(harness_main, tmp_path: Path) -> None:
    run = harness_main("run", "strict-vs-stale", "--set", "arms.stale.delay=3", "--out", tmp_path / "run")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr == "error: --set arms.stale.delay: delay 3 exceeds max_gradient_staleness 2\n"
    assert not (tmp_path / "run").exists()


# --- validation and checks, without launching ------------------------------------------------

SUITE = """
name = "pipeline"
description = "a versioned and a plain arm"
ranks = 2
steps = 4
[arms.stale]
delay = 2
[arms.plain]
"""
ONE_CHECK = '[[checks]]\nkind = "exactly-once"\n'


@pytest.mark.parametrize(
    "extra,expected",
    [
        ("", None),
        ('[[checks]]\nkind = "exactly-once"\narms = ["plain"]\n', 'checks.0.arms.0: arm "plain" is not versioned'),
        (
            '[[checks]]\nkind = "correction-stats"\narms = ["stale"]\n',
            'checks.0.arms.0: arm "stale" has correction = "off"',
        ),
        (
            '[[checks]]\nkind = "correction-stats"\n',
            "checks.0: needs a versioned arm with a correction; the suite has none",
        ),
        ("[arms.late]\ndelay = 3\n", "arms.late.delay: delay 3 exceeds max_gradient_staleness 2"),
        ("[arms.late]\ndelay = 3\nmax_gradient_staleness = 3\n", None),
        ("[arms.twice]\napply_twice_batch = 5\n", "arms.twice.apply_twice_batch: expected a batch id in 1-4, got 5"),
        ('[arms.odd]\nretention = "swap"\n', "arms.odd.retention: retention must be one of"),
        ("[arms.neg]\ndelay = -1\n", "arms.neg.delay: expected int >= 0, got -1"),
    ],
    ids=[
        "valid",
        "plain-arm",
        "correction-off",
        "no-corrected-arm",
        "delay-over-max",
        "raised-max",
        "batch-out-of-range",
        "retention",
        "negative-delay",
    ],
)
def test_pipeline_fields_are_validated(tmp_path: Path, extra: str, expected: str | None) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE + extra + ("" if "[[checks]]" in extra else ONE_CHECK))
    if expected is None:
        suite = load_suite(str(path))
        assert suite.arms["stale"].emits(VERSIONED) and not suite.arms["plain"].emits(VERSIONED)
        return
    with pytest.raises(SuiteError) as info:
        load_suite(str(path))
    assert str(info.value).startswith(f"{path}: {expected}")


def _updates(*rows: tuple[list[int], list[int]], **stats: list) -> list[dict]:
    """Update records of steps 1..n from (batches_applied, ages) pairs and optional per-step columns."""
    return [
        {"step": k, "batches_applied": b, "ages": a, **{key: values[k - 1] for key, values in stats.items()}}
        for k, (b, a) in enumerate(rows, start=1)
    ]


def test_exactly_once_names_a_lost_batch() -> None:
    result = check_exactly_once(_updates(([1], [0]), ([3], [1])), range(1, 4))
    assert result.status == "fail" and result.detail == "batch 2 never applied"


def test_staleness_ages_name_the_first_wrong_step() -> None:
    result = check_staleness_ages(_updates(([1], [0]), ([2], [1]), ([3], [1])), delay=2)
    assert result.status == "fail" and result.first_divergent_step == 3
    assert result.detail == "step 3: ages [1], expected 2 at delay 2"


@pytest.mark.parametrize(
    "mean,clipped,status,detail",
    [
        ([1.0, None], [0.0, None], "pass", "no corrected tokens at steps 2"),
        ([1.0, math.nan], [0.0, 0.0], "fail", "step 2: correction mean is non-finite (nan)"),
        ([1.0, 5.5], [0.0, 0.0], "fail", "step 2: correction mean 5.5 is outside [0, 5]"),
        ([1.0, 1.0], [0.0, 1.5], "fail", "step 2: correction clipped frac 1.5 is outside [0, 1]"),
    ],
    ids=["absent", "nan", "over-clip", "fraction"],
)
def test_correction_stats_fail_only_on_impossible_values(mean: list, clipped: list, status: str, detail: str) -> None:
    updates = _updates(([1], [0]), ([2], [1]), correction_mean=mean, correction_clipped_frac=clipped)
    result = check_correction_stats(updates, "when_available", delay=1)
    assert result.status == status and detail in result.detail, result.detail
    with pytest.raises(ValueError, match="correction is off"):
        check_correction_stats(updates, "off", delay=1)


@pytest.mark.parametrize(
    "correction,mean,detail",
    [
        ("always", [None, None, None], 'step 1: no correction statistics under correction = "always" (and 2 more)'),
        ("always", [1.0, 1.0, 1.0], "mean weight exactly 1 at every stale step (2-3): the correction was not applied"),
        ("when_available", [None, None, None], "no step of 3 reported correction statistics under when_available"),
    ],
    ids=["always-null", "always-stuck-at-1", "when-available-never"],
)
def test_correction_stats_never_pass_a_correction_that_did_nothing(correction: str, mean: list, detail: str) -> None:
    clipped = [None if m is None else 0.0 for m in mean]
    updates = _updates(([1], [0]), ([2], [1]), ([3], [1]), correction_mean=mean, correction_clipped_frac=clipped)
    result = check_correction_stats(updates, correction, delay=1)
    assert result.status == "fail" and result.detail == detail
    working = _updates(
        ([1], [0]), ([2], [1]), ([3], [1]), correction_mean=[1.0, 0.98, 1.01], correction_clipped_frac=[0.0] * 3
    )
    assert check_correction_stats(working, "always", delay=1).status == "pass"


def test_min_clipped_frac_needs_every_stale_step_clipped() -> None:
    def stats(clipped: list[float]):
        updates = _updates(
            ([1], [0]), ([2], [1]), ([3], [1]), correction_mean=[1.0, 0.98, 0.99], correction_clipped_frac=clipped
        )
        return check_correction_stats(updates, "always", delay=1, clip=1.01, min_clipped_frac=0.2)

    assert stats([0.0, 0.5, 0.4]).status == "pass"  # step 1 is not stale: nothing to clip there
    unclipped = stats([0.0, 0.5, 0.1])
    assert unclipped.status == "fail" and unclipped.first_divergent_step == 3
    assert unclipped.detail == "step 3: clipped fraction 0.1 under min_clipped_frac 0.2: the clip at 1.01 did not act"


@pytest.mark.parametrize(
    "value,message",
    [(0, "expected a number > 0, got 0"), (1.5, "expected a fraction in (0, 1], got 1.5"), ("x", "expected a number")],
)
def test_min_clipped_frac_is_validated(tmp_path: Path, value: object, message: str) -> None:
    text = (Path(__file__).resolve().parents[2] / "suites" / "strict-vs-stale.toml").read_text()
    path = tmp_path / "suite.toml"
    path.write_text(text.replace("min_clipped_frac = 0.2", f"min_clipped_frac = {value!r}".replace("'", '"')))
    with pytest.raises(SuiteError, match="min_clipped_frac: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_suite(str(path))
    path.write_text(text.replace('kind = "staleness-ages"', 'kind = "staleness-ages"\nmin_clipped_frac = 0.5'))
    with pytest.raises(SuiteError, match=r"min_clipped_frac: unknown key"):
        load_suite(str(path))


def test_pipeline_plan_counts_every_exchange_of_a_tick() -> None:
    """Matches the events of VersionedTrainer(delay=2, replay, always) over 4 batches, tick by tick."""
    plan = pipeline_plan(4, 2, replay=True, always_correct=True)
    assert plan == {
        (0, "fwd"): 1, (1, "fwd"): 1,
        (2, "fwd"): 1, (2, "bwd"): 1, (2, "recompute"): 1,  # batch 0's forward ran at the current version
        (3, "fwd"): 2, (3, "bwd"): 1, (3, "recompute"): 1,
        (4, "fwd"): 1, (4, "bwd"): 1, (4, "recompute"): 1,  # drained: only the correction's forward
        (5, "fwd"): 1, (5, "bwd"): 1, (5, "recompute"): 1,
    }  # fmt: skip
