from __future__ import annotations

import math

import pytest

from harness.abba import abba_order, abba_step_time, measure_abba, paired_ratio


def test_order_is_whole_abba_blocks() -> None:
    assert abba_order(2) == ["A", "B", "B", "A", "A", "B", "B", "A"]


def test_linear_drift_cancels_inside_each_block() -> None:
    # B is truly 1.25x slower; the machine slows down by 1 unit per run. Running all A then all B
    # would report a badly inflated ratio; ABBA recovers 1.25 exactly.
    order = abba_order(4)
    values = [(10.0 if arm == "A" else 12.5) * 1.0 + i for i, arm in enumerate(order)]
    drift_free = paired_ratio(order, [(10.0 if a == "A" else 12.5) for a in order])
    assert drift_free.ratio == pytest.approx(1.25)
    drifting = paired_ratio(order, values)
    sequential = (sum(12.5 + 16 + i for i in range(16)) / 16) / (sum(10.0 + i for i in range(16)) / 16)
    assert abs(math.log(drifting.ratio)) < abs(math.log(sequential))
    assert drifting.low <= drifting.ratio <= drifting.high


def test_interval_covers_truth_and_narrows_with_more_blocks() -> None:
    import random

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
