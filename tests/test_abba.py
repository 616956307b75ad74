from __future__ import annotations

import random
import statistics
from typing import Callable

import pytest

from harness.abba import PairedRatio, abba_order, abba_step_time, measure_abba, paired_ratio


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


def _abba(noise: Callable[[], float] = lambda: 0.0) -> PairedRatio:
    order = abba_order(BLOCKS)
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
    result = _abba(lambda: rng.gauss(0, 0.02))
    assert result.ratio == pytest.approx(PLANTED, rel=0.03)
    assert result.low <= PLANTED <= result.high
    assert result.high / result.low < 1.15  # an interval, not a shrug
    sequential = _sequential_ratio(2 * BLOCKS, lambda: rng.gauss(0, 0.02))
    assert not result.low <= sequential <= result.high
    assert sequential > PLANTED * 1.10


def test_interval_covers_the_planted_ratio_about_95_percent_of_the_time() -> None:
    # With 4 blocks the interval rests on 3 degrees of freedom: a normal quantile (1.96 for 3.18)
    # covers about 85% of the time, a standard error over n instead of sqrt(n) less; an interval
    # that ignores the pairing (the drift becomes spread) nearly always. Over 1000 repetitions a
    # true 95% lies within these bounds by over 3 standard errors (0.7%).
    repetitions = 1000
    rng = random.Random(7)
    covered = 0
    for _ in range(repetitions):
        result = _abba(lambda: rng.gauss(0, 0.02))
        covered += result.low <= PLANTED <= result.high
    assert 0.92 <= covered / repetitions <= 0.975, f"covered the planted ratio in {covered} of {repetitions}"


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
