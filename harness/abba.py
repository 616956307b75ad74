"""ABBA scheduling and the anytime-valid interval of a B/A throughput ratio.

Runs go A B B A, A B B A, ...: within each block a linear drift of the machine cancels in the
mean difference, which running all A then all B cannot promise (Duplyakin et al., ATC'23). Each
block yields one paired ratio ``mean(B) / mean(A)``; the estimate is the geometric mean of those
ratios (ratio of means, Kalibera & Jones), plus a noise flag when the spread within an arm is
large (torch.utils.benchmark's IQR/median > 10%).

The interval is a confidence sequence, not a fixed-sample Student-t interval: it holds at every
block count at once, so a gate may look after every block and stop as soon as the interval clears
its threshold without inflating its error (optional stopping). A Student-t interval checked after
every block excludes the truth in about a third of A/A runs by 50 blocks (tests/test_abba.py).
The sequence is Lai's (1976) for a normal mean of unknown variance, from the scale-invariant
mixture of likelihood ratios (Wang & Ramdas, "Anytime-valid t-tests and confidence sequences for
Gaussian means with unknown variance", Sequential Analysis 2024): with t blocks of log ratios of
mean m and sum of squared deviations SS, a centre c is outside when

    L_t(c) = sqrt(rho / (t + rho)) * (Q / (Q - S**2 / (t + rho)))**(t / 2) >= 1 / alpha,
    S = sum(x - c) = t (m - c),  Q = sum((x - c)**2) = SS + t (m - c)**2,

a martingale with L = 1 at t = 1, so Ville's inequality bounds the chance that it ever crosses.
The set is an interval around m with a closed-form half-width (:func:`confidence_sequence`).
Measured on this project's block series (benchmarks/abba_sensitivity.py, docs/throughput.md),
per-block log ratios are close to normal (excess kurtosis near 0, lag-1 autocorrelation near 0.1);
heavy tails and outliers only widen it (tests/test_abba.py measures its coverage under each).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

BLOCK = ("A", "B", "B", "A")
NOISY_IQR = 0.10  # relative IQR within an arm above which a comparison is flagged noisy
# The mixture's prior precision, in units of the block-to-block spread: 0.5 bounds the interval
# from 4 blocks on and decides a true 10% against a 5% gate, at this machine's 10% spread per
# block, in a median of 43 blocks (20% in 9); 3 saves a tenth of the late blocks but needs 7
# before the interval is finite.
MIXTURE_PRECISION = 0.5


def abba_order(blocks: int) -> list[str]:
    """The arm to run at each position: ``blocks`` repetitions of A B B A."""
    return [arm for _ in range(blocks) for arm in BLOCK]


@dataclass(frozen=True)
class Interval:
    """B/A after some whole blocks: the geometric mean ``ratio`` and the confidence sequence's bounds
    (0 and inf until the blocks can bound it)."""

    blocks: int
    ratio: float
    low: float
    high: float


@dataclass(frozen=True)
class PairedRatio:
    """B relative to A: ``ratio`` > 1 means B takes longer (for times) or does more (for rates).
    ``sequence`` holds the interval after every block; the last is this one's."""

    ratio: float
    low: float
    high: float
    blocks: int
    confidence: float
    noisy: bool
    sequence: tuple[Interval, ...] = ()

    def summary(self, label_a: str = "A", label_b: str = "B") -> str:
        noise = "  (noisy: IQR/median > 10% in an arm)" if self.noisy else ""
        return (
            f"{label_b}/{label_a} = {self.ratio:.4f}  "
            f"[{self.low:.4f}, {self.high:.4f}] {self.confidence:.0%} interval over {self.blocks} ABBA blocks{noise}"
        )


def relative_iqr(values: Sequence[float]) -> float:
    """(Q3 - Q1) / median: the spread torch.utils.benchmark flags above 10%."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


def block_log_ratios(order: Sequence[str], values: Sequence[float]) -> list[float]:
    """``log(mean(B) / mean(A))`` of each whole block of measurements taken in ``order``."""
    if len(order) != len(values) or len(order) % len(BLOCK):
        raise ValueError(f"need whole ABBA blocks of measurements, got {len(values)} for {len(order)} positions")
    log_ratios = []
    for start in range(0, len(order), len(BLOCK)):
        block = list(zip(order[start : start + len(BLOCK)], values[start : start + len(BLOCK)]))
        mean_a = statistics.fmean(v for arm, v in block if arm == "A")
        mean_b = statistics.fmean(v for arm, v in block if arm == "B")
        log_ratios.append(math.log(mean_b / mean_a))
    return log_ratios


def confidence_sequence(
    log_ratios: Sequence[float], confidence: float = 0.95, rho: float = MIXTURE_PRECISION
) -> list[tuple[float, float]]:
    """(mean, half-width) of the log ratio after each of the first 1..n blocks: Lai's confidence
    sequence (module docstring), which covers the true mean at every n at once with ``confidence``.
    The half-width is inf until the blocks can exclude anything (4 at rho 0.5, 95%).

    Solving L_t(c) = 1/alpha for u = (m - c)**2 / SS: with R = ((1/alpha) sqrt((t + rho) / rho))**(2/t),
    u = (R - 1) / (t (1 - R rho / (t + rho))), finite only while R rho < t + rho."""
    alpha = 1 - confidence
    out: list[tuple[float, float]] = []
    total = total_sq = 0.0
    for t, x in enumerate(log_ratios, start=1):
        total += x
        total_sq += x * x
        mean = total / t
        squares = max(total_sq - t * mean * mean, 0.0)
        r = ((1 / alpha) * math.sqrt((t + rho) / rho)) ** (2 / t)
        bounded = t > 1 and r * rho < t + rho
        out.append((mean, math.sqrt((r - 1) / (t * (1 - r * rho / (t + rho))) * squares) if bounded else math.inf))
    return out


def student_t_intervals(log_ratios: Sequence[float], confidence: float = 0.95) -> list[tuple[float, float]]:
    """(mean, half-width) after each of the first 1..n blocks, each a fixed-sample Student-t
    interval: right for a block count fixed in advance and looked at once (the benchmarks), wrong
    for a gate that looks after every block (module docstring)."""
    from scipy import stats  # imported here: ~0.4 s that only a fixed-sample interval needs

    out = [(log_ratios[0], math.inf)] if log_ratios else []
    for t in range(2, len(log_ratios) + 1):
        head = log_ratios[:t]
        spread = statistics.stdev(head) / math.sqrt(t)
        out.append((statistics.fmean(head), stats.t.ppf(0.5 + confidence / 2, t - 1) * spread))
    return out


def paired_ratio(
    order: Sequence[str], values: Sequence[float], confidence: float = 0.95, anytime: bool = True
) -> PairedRatio:
    """Summarise measurements taken in ``order`` (from :func:`abba_order`) as a paired B/A ratio,
    with the interval after every block in ``sequence``: the confidence sequence, or with
    ``anytime=False`` the fixed-sample Student-t interval of a block count chosen in advance."""
    log_ratios = block_log_ratios(order, values)
    intervals = confidence_sequence if anytime else student_t_intervals
    sequence = tuple(
        Interval(k, math.exp(mean), math.exp(mean - half), math.exp(mean + half))
        for k, (mean, half) in enumerate(intervals(log_ratios, confidence), start=1)
    )
    last = sequence[-1]
    per_arm = [[v for arm, v in zip(order, values) if arm == name] for name in ("A", "B")]
    noisy = any(len(v) >= 4 and relative_iqr(v) > NOISY_IQR for v in per_arm)
    return PairedRatio(last.ratio, last.low, last.high, last.blocks, confidence, noisy, sequence)


def gate_verdict(low: float, high: float, threshold: float) -> str:
    """The gate on an interval of B/A step time: "pass" when it lies at or under ``threshold``,
    "fail" when above it, "inconclusive" while it straddles it."""
    return "pass" if high <= threshold else "fail" if low > threshold else "inconclusive"


def measure_abba(run_a: Callable[[], float], run_b: Callable[[], float], blocks: int) -> PairedRatio:
    """Call the two measurements in ``blocks`` ABBA blocks, fixed in advance, and summarise them
    with the fixed-sample interval."""
    order = abba_order(blocks)
    values = [(run_a if arm == "A" else run_b)() for arm in order]
    return paired_ratio(order, values, anytime=False)


class Steppable(Protocol):
    """A trainer: ``step(n)`` trains one step (the reference's trainers all qualify)."""

    def step(self, step: int) -> object: ...


def abba_step_time(
    trainer_a: Steppable, trainer_b: Steppable, *, blocks: int, steps: int, warmup: int = 2, first_step: int = 0
) -> PairedRatio:
    """Seconds per ``step()`` of two already built trainers, B over A, in ABBA blocks of ``steps``.

    Each trainer keeps training its own model across its blocks (its own step counter, from
    ``first_step``), after ``warmup`` untimed steps each, so that build and trace stay outside."""
    counters = {id(t): itertools.count(first_step) for t in (trainer_a, trainer_b)}

    def timed(trainer: Steppable, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            trainer.step(next(counters[id(trainer)]))
        return (time.perf_counter() - start) / max(count, 1)

    for trainer in (trainer_a, trainer_b):
        timed(trainer, warmup)
    return measure_abba(lambda: timed(trainer_a, steps), lambda: timed(trainer_b, steps), blocks)
