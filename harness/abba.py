"""ABBA scheduling and paired statistics for A-vs-B throughput.

Runs go A B B A, A B B A, ...: within each block a linear drift of the machine cancels in the
mean difference, which running all A then all B cannot promise (Duplyakin et al., ATC'23). Each
block yields one paired ratio ``mean(B) / mean(A)``; the report is the geometric mean of those
ratios with a Student-t interval over their logs (ratio of means, Kalibera & Jones), plus a
noise flag when the spread within an arm is large (torch.utils.benchmark's IQR/median > 10%).
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


def abba_order(blocks: int) -> list[str]:
    """The arm to run at each position: ``blocks`` repetitions of A B B A."""
    return [arm for _ in range(blocks) for arm in BLOCK]


@dataclass(frozen=True)
class PairedRatio:
    """B relative to A: ``ratio`` > 1 means B takes longer (for times) or does more (for rates)."""

    ratio: float
    low: float
    high: float
    blocks: int
    confidence: float
    noisy: bool

    def summary(self, label_a: str = "A", label_b: str = "B") -> str:
        noise = "  (noisy: IQR/median > 10% in an arm)" if self.noisy else ""
        return (
            f"{label_b}/{label_a} = {self.ratio:.4f}  "
            f"[{self.low:.4f}, {self.high:.4f}] {self.confidence:.0%} CI over {self.blocks} ABBA blocks{noise}"
        )


def relative_iqr(values: Sequence[float]) -> float:
    """(Q3 - Q1) / median: the spread torch.utils.benchmark flags above 10%."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / statistics.median(values)


def paired_ratio(order: Sequence[str], values: Sequence[float], confidence: float = 0.95) -> PairedRatio:
    """Summarise measurements taken in ``order`` (from :func:`abba_order`) as a paired B/A ratio."""
    if len(order) != len(values) or len(order) % len(BLOCK):
        raise ValueError(f"need whole ABBA blocks of measurements, got {len(values)} for {len(order)} positions")
    log_ratios = []
    for start in range(0, len(order), len(BLOCK)):
        block = list(zip(order[start : start + len(BLOCK)], values[start : start + len(BLOCK)]))
        mean_a = statistics.fmean(v for arm, v in block if arm == "A")
        mean_b = statistics.fmean(v for arm, v in block if arm == "B")
        log_ratios.append(math.log(mean_b / mean_a))
    mean = statistics.fmean(log_ratios)
    if len(log_ratios) > 1:
        from scipy import stats  # imported here: ~0.4 s that only a throughput verdict needs

        half = (
            stats.t.ppf(0.5 + confidence / 2, len(log_ratios) - 1)
            * statistics.stdev(log_ratios)
            / math.sqrt(len(log_ratios))
        )
    else:
        half = math.inf
    per_arm = [[v for arm, v in zip(order, values) if arm == name] for name in ("A", "B")]
    noisy = any(len(v) >= 4 and relative_iqr(v) > NOISY_IQR for v in per_arm)
    return PairedRatio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(log_ratios), confidence, noisy)


def measure_abba(run_a: Callable[[], float], run_b: Callable[[], float], blocks: int) -> PairedRatio:
    """Call the two measurements in ABBA order and summarise them."""
    order = abba_order(blocks)
    values = [(run_a if arm == "A" else run_b)() for arm in order]
    return paired_ratio(order, values)


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
