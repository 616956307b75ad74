"""A vs B throughput: which measurements a throughput run makes (its gate is the check family
:mod:`harness.checks.throughput`).

A throughput run (a suite's ``[throughput]`` table, or ``harness abba``) times arm A against arm B
in ABBA blocks (harness/abba.py says why that order). Both arms are built once, in the same rank
processes when they have the same process count, and each keeps training its own model across
its blocks; the ranks stream one line per block position to ``throughput.jsonl`` (harness/worker.py).
Arms of different process counts cannot share processes: each block position is then a launch
of its own, which rebuilds its arm, warms it up and starts again from step 1.

"""

from __future__ import annotations

from dataclasses import dataclass

from harness.abba import BLOCK
from harness.launchers import LaunchGroup
from harness.specs import SuiteSpec, ThroughputSpec

SERIES = ("main", "control")


@dataclass(frozen=True)
class Measurement:
    """One block position: ``copy`` names the trainer it times (``A``, ``B``, or ``A2``, the
    control's second copy of A), ``role`` its place in the block's A B B A."""

    series: str
    block: int
    position: int
    role: str
    copy: str
    arm: str


def plan_measurements(spec: ThroughputSpec) -> list[Measurement]:
    """Every block position in the order it runs: block k of the main series, then (with
    ``control``) block k of A against its copy, so both series see the same drift."""
    copies = {"main": {"A": ("A", spec.a), "B": ("B", spec.b)}, "control": {"A": ("A", spec.a), "B": ("A2", spec.a)}}
    plan = []
    for block in range(1, spec.blocks + 1):
        for series in SERIES if spec.control else ("main",):
            for position, role in enumerate(BLOCK):
                copy, arm = copies[series][role]
                plan.append(Measurement(series, block, position, role, copy, arm))
    return plan


def plan_throughput_launches(suite: SuiteSpec) -> list[LaunchGroup]:
    """One launch holding every measurement when A and B have one process count; else one each."""
    spec = suite.throughput
    plan = plan_measurements(spec)
    ranks = {suite.arms[spec.a].ranks, suite.arms[spec.b].ranks}
    if len(ranks) == 1:
        arms = tuple(dict.fromkeys((spec.a, spec.b)))
        return [LaunchGroup("+".join(arms), ranks.pop(), arms, "logs", tuple(plan))]
    groups = []
    for m in plan:
        name = f"{m.series}-b{m.block}p{m.position}-{m.arm}"
        groups.append(LaunchGroup(name, suite.arms[m.arm].ranks, (m.arm,), f"logs/{name}", (m,)))
    return groups
