from __future__ import annotations

import math
import random
import statistics
from typing import Callable

import pytest

from harness.abba import (
    PairedRatio,
    abba_order,
    abba_step_time,
    block_log_ratios,
    confidence_sequence,
    gate_verdict,
    measure_abba,
    paired_ratio,
    student_t_intervals,
)


def test_order_is_whole_abba_blocks() -> None:
    assert abba_order(2) == ["A", "B", "B", "A", "A", "B", "B", "A"]


# B truly takes 1.25x as long as A. The machine slows down linearly over the session: run i takes
# SLOWDOWN_PER_RUN * i longer than it would at the start (a slowness factor, so it scales A and B alike).
PLANTED = 1.25
SLOWDOWN_PER_RUN = 0.02
BLOCKS = 4


def _run_time(arm: str, position: int, noise: float = 0.0) -> float:
    return (1.0 if arm == "A" else PLANTED) * (1 + SLOWDOWN_PER_RUN * position) * (1 + noise)


def _sequential_ratio(runs_per_arm: int, noise: Callable[[], float] = lambda: 0.0) -> float:
    """What a naive tool reports: all A runs, then all B runs, ratio of the means."""
    order = ["A"] * runs_per_arm + ["B"] * runs_per_arm
    times = [_run_time(arm, i, noise()) for i, arm in enumerate(order)]
    return statistics.fmean(times[runs_per_arm:]) / statistics.fmean(times[:runs_per_arm])


def _abba(noise: Callable[[], float] = lambda: 0.0, blocks: int = BLOCKS) -> PairedRatio:
    order = abba_order(blocks)
    return paired_ratio(order, [_run_time(arm, i, noise()) for i, arm in enumerate(order)])


def test_linear_drift_cancels_inside_each_block() -> None:
    # Within A B B A the A runs and the B runs have the same mean position, so a linear slowdown
    # scales both means alike and every block's ratio is the planted one, exactly.
    result = _abba()
    assert result.ratio == pytest.approx(PLANTED, rel=1e-12)
    assert result.low == pytest.approx(PLANTED, rel=1e-12) and result.high == pytest.approx(PLANTED, rel=1e-12)
    # The same 16 runs in sequence: B ran later, on a slower machine, and takes the blame (1.44).
    sequential = _sequential_ratio(2 * BLOCKS)
    assert sequential > PLANTED * 1.10


def test_abba_recovers_a_planted_ratio_under_drift_and_noise() -> None:
    rng = random.Random(1)
    result = _abba(lambda: rng.gauss(0, 0.02), blocks=12)
    assert result.ratio == pytest.approx(PLANTED, rel=0.03)
    assert result.low <= PLANTED <= result.high
    assert result.high / result.low < 1.15  # an interval, not a shrug
    sequential = _sequential_ratio(2 * BLOCKS, lambda: rng.gauss(0, 0.02))
    assert not result.low <= sequential <= result.high
    assert sequential > PLANTED * 1.10


# Synthetic block series like this machine's (per-block log ratios with a spread near 10%,
# benchmarks/abba_sensitivity.py), made harder three ways: a machine that drifts (a slow swell of
# 30% and back over the run, which ABBA cancels only approximately), heavy tails (Student-t with 3
# degrees of freedom in every position's time) and outliers (1 position in 100 takes 1.2-2x as long,
# a noisy neighbour). A gate looks after every block, as `--blocks auto` does, and stops once its
# interval clears the 5% threshold or after 100 blocks.
THRESHOLD = 1.05
MAX_BLOCKS = 100
RUNS = 200


def _heavy_tailed(rng: random.Random) -> float:
    """Student-t, 3 degrees of freedom, scaled to unit variance."""
    chi2 = sum(rng.gauss(0, 1) ** 2 for _ in range(3))
    return rng.gauss(0, 1) / math.sqrt(chi2 / 3) / math.sqrt(3)


def _block_series(rng: random.Random, slowdown: float, noise: str) -> list[float]:
    order = abba_order(MAX_BLOCKS)
    times = []
    for i, arm in enumerate(order):
        drift = 1 + 0.3 * math.sin(math.pi * i / len(order))
        spread = _heavy_tailed(rng) if noise == "heavy-tails" else rng.gauss(0, 1)
        time_ = 0.1 * (1 + slowdown if arm == "B" else 1) * drift * math.exp(0.07 * spread)
        if noise == "outliers" and rng.random() < 0.01:
            time_ *= rng.uniform(1.2, 2.0)
        times.append(time_)
    return block_log_ratios(order, times)


def _gate_runs(slowdown: float, noise: str, interval=confidence_sequence, seed: int = 0) -> list[tuple]:
    """(verdict, blocks used, low, high) of RUNS adaptive gates on fresh series."""
    rng = random.Random(seed)
    runs = []
    for _ in range(RUNS):
        sequence = interval(_block_series(rng, slowdown, noise))
        for blocks, (mean, half) in enumerate(sequence, start=1):
            low, high = math.exp(mean - half), math.exp(mean + half)
            verdict = gate_verdict(low, high, THRESHOLD) if blocks >= 2 else "inconclusive"
            if verdict != "inconclusive" or blocks == MAX_BLOCKS:
                runs.append((verdict, blocks, low, high))
                break
    return runs


def _share(runs: list[tuple], verdict: str) -> float:
    return sum(run[0] == verdict for run in runs) / len(runs)


@pytest.mark.parametrize("noise", ["normal", "heavy-tails", "outliers"])
def test_an_adaptive_gate_keeps_its_error_on_identical_arms(noise: str) -> None:
    runs = _gate_runs(0.0, noise)
    covered = sum(low <= 1.0 <= high for _, _, low, high in runs) / RUNS
    assert covered >= 0.93 and _share(runs, "fail") <= 0.01, (covered, _share(runs, "fail"))
    assert _share(runs, "pass") >= 0.8  # and it does decide: A is not slower than A


@pytest.mark.parametrize("noise", ["normal", "heavy-tails", "outliers"])
def test_an_adaptive_gate_seldom_passes_a_slowdown_at_its_threshold(noise: str) -> None:
    # At the threshold itself a 95% interval may lie under it by chance in up to 2.5% of runs, at
    # any of the looks together; 5% here leaves room for the sampling error of 200 runs.
    runs = _gate_runs(0.05, noise)
    assert _share(runs, "pass") <= 0.05 and _share(runs, "fail") + _share(runs, "inconclusive") >= 0.95


def test_the_old_student_t_interval_looked_at_after_every_block_passes_a_slowdown_at_the_threshold() -> None:
    # The same runs, judged with a fixed-sample interval after every block: its error is spent
    # again at every look, and a 5% slowdown passes a 5% gate in about a fifth of the runs.
    runs = _gate_runs(0.05, "normal", interval=student_t_intervals)
    assert _share(runs, "pass") > 0.10
    covered = sum(low <= THRESHOLD <= high for _, _, low, high in runs) / RUNS
    assert covered < 0.93


@pytest.mark.parametrize("noise", ["normal", "heavy-tails", "outliers"])
def test_an_adaptive_gate_fails_a_10_percent_slowdown_and_a_20_percent_one_sooner(noise: str) -> None:
    ten, twenty = _gate_runs(0.10, noise), _gate_runs(0.20, noise)
    assert _share(ten, "fail") >= 0.8 and _share(twenty, "fail") >= 0.99
    assert statistics.median(r[1] for r in twenty) < statistics.median(r[1] for r in ten) / 2


def test_the_sequence_is_unbounded_until_four_blocks_and_exact_without_noise() -> None:
    sequence = confidence_sequence([0.1, 0.3, -0.1, 0.2, 0.0])
    assert [math.isinf(half) for _, half in sequence] == [True, True, True, False, False]
    assert confidence_sequence([0.2] * 5)[-1] == pytest.approx((0.2, 0.0), abs=1e-7)


def test_interval_covers_truth_and_narrows_with_more_blocks() -> None:
    rng = random.Random(0)

    def noisy(mean: float) -> float:
        return mean * (1 + rng.gauss(0, 0.02))

    few = measure_abba(lambda: noisy(1.0), lambda: noisy(1.1), blocks=3)
    many = measure_abba(lambda: noisy(1.0), lambda: noisy(1.1), blocks=30)
    assert many.low < 1.1 < many.high
    assert (many.high - many.low) < (few.high - few.low)
    assert not many.noisy


def test_noise_flag_and_bad_input() -> None:
    order = abba_order(2)
    assert paired_ratio(order, [1, 1, 1, 1, 1, 3, 3, 1]).noisy
    with pytest.raises(ValueError, match="whole ABBA blocks"):
        paired_ratio(order[:6], [1.0] * 6)


class _Recorder:
    """A trainer that only remembers which steps it was asked to train, in order."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def step(self, step: int) -> None:
        self.steps.append(step)


def test_abba_step_time_trains_each_trainer_on_its_own_consecutive_steps() -> None:
    a, b = _Recorder(), _Recorder()
    result = abba_step_time(a, b, blocks=3, steps=4, warmup=2, first_step=1)
    # 2 warm-up steps, then 3 blocks of A B B A: each trainer runs 2 measurements of 4 steps per block.
    assert a.steps == b.steps == list(range(1, 1 + 2 + 3 * 2 * 4))
    assert result.blocks == 3
