"""A vs B throughput: what a throughput run's block rows add up to, and when it stops measuring (its
block positions are planned in harness/plan.py; its gate is the check family
:mod:`harness.checks.throughput`).

A throughput run (a suite's ``[throughput]`` table, or ``harness abba``) times arm A against arm B
in ABBA blocks (harness/abba.py says why that order). Both arms are built once, in the same rank
processes when they have the same process count, and each keeps training its own model across
its blocks; the ranks stream one line per block position to ``throughput.jsonl`` (harness/rank/throughput.py).
Arms of different process counts cannot share processes: each block position is then a launch
of its own, which rebuilds its arm, warms it up and starts again from step 1.

With ``blocks = "auto"`` the run is planned for ``max_blocks`` and stops early: after every whole
block :func:`stop_reason` asks whether the gate's interval already clears its threshold, which the
interval allows at any block (harness/abba.py), or whether ``budget_s`` is spent. The ranks ask
after each block they measured, all with the same reduced times, so they stop together; the
launcher asks between the launches of separate block positions; and the gate asks once more, to
say why the run stopped where it did.
"""

from __future__ import annotations

import statistics

from harness.abba import BLOCK, gate_verdict, paired_ratio
from harness.specs import ThroughputSpec


def whole_blocks(rows: list[dict], series: str) -> tuple[list[str], list[float], list[float]]:
    """(roles, step times) of the series' complete blocks, in run order, and its per-block ratios;
    a block cut short (a rank failed, a signal) has no paired ratio and is left out."""
    by_block: dict[int, list[dict]] = {}
    for row in rows:
        if row["series"] == series:
            by_block.setdefault(row["block"], []).append(row)
    roles, times, ratios = [], [], []
    for block in sorted(by_block):
        positions = sorted(by_block[block], key=lambda r: r["position"])
        if [r["role"] for r in positions] != list(BLOCK):
            continue
        roles += [r["role"] for r in positions]
        times += [r["step_time_s"] for r in positions]
        mean = {role: statistics.fmean(r["step_time_s"] for r in positions if r["role"] == role) for role in "AB"}
        ratios.append(mean["B"] / mean["A"])
    return roles, times, ratios


def measuring_seconds(rows: list[dict]) -> float | None:
    """Wall seconds from the start of the first measurement to the end of the last; None for rows
    without ``end_time`` (the epoch time a measurement ended, latest over the ranks)."""
    if not rows or "end_time" not in rows[0] or "end_time" not in rows[-1]:
        return None
    return rows[-1]["end_time"] - (rows[0]["end_time"] - rows[0]["seconds"])


def stop_reason(spec: ThroughputSpec, rows: list[dict]) -> str | None:
    """Why the run stops measuring after ``rows`` (throughput.jsonl so far, in run order), or None
    while it goes on. Only a whole block (of the control too, when it runs) can end a run."""
    last = rows[-1] if rows else None
    if last is None or last["position"] != len(BLOCK) - 1 or last["series"] != ("control" if spec.control else "main"):
        return None
    roles, times, _ = whole_blocks(rows, "main")
    blocks, seconds = len(roles) // len(BLOCK), measuring_seconds(rows)
    if not spec.adaptive:
        return f"the {blocks} blocks of --blocks {spec.blocks}" if blocks >= spec.planned_blocks else None
    if blocks >= 2:
        ratio = paired_ratio(roles, times)
        if gate_verdict(ratio.low, ratio.high, 1 + spec.max_slowdown) != "inconclusive":
            return f"the interval cleared the threshold after {blocks} blocks"
    if blocks >= spec.max_blocks:
        return f"--max-blocks {spec.max_blocks} reached"
    if seconds is not None and seconds >= spec.budget_s and blocks >= 2:  # 2: the fewest the gate judges
        return f"--budget-s {spec.budget_s:g} spent ({seconds:.0f} s, {blocks} blocks)"
    return None
