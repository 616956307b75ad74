"""``throughput``: the ABBA gate of a throughput run (a suite's ``[throughput]`` table, ``harness abba``).

On the B/A step-time ratio's interval and ``1 + max_slowdown``: pass when the upper bound is at
or under it, fail (exit 1) when the lower bound is above it, otherwise inconclusive (exit 4:
neither a regression nor a flake; rerun with more blocks). The interval is the confidence
sequence of harness/abba.py, which holds after any number of blocks, so the same verdict stops an
adaptive run (``blocks = "auto"``, harness/throughput.py) and judges it. An A/A control (``control``) whose own
interval lies beyond the threshold, either way, makes the run inconclusive: the machine is too
noisy for the gate to mean anything. Every throughput run has this one check, and no suite lists
it: the run plans it (:func:`gate_check`). It reads the rows of ``throughput.jsonl`` that the
read step put in ``RunRecords.throughput``.
"""

from __future__ import annotations

import dataclasses
import statistics

from harness.abba import PairedRatio, gate_verdict, paired_ratio, relative_iqr
from harness.checks.registry import CheckFamily, register
from harness.plan import LaunchGroup
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec, ThroughputSpec
from harness.subject.protocol import METRICS, SuiteReader
from harness.throughput import measuring_seconds, stop_reason, whole_blocks

KIND = "throughput"
# B this much faster than A (step time ratio under 1 / (1 + this)) usually means the baseline
# moved, not that the change is a gift: the report says so prominently.
IMPROVEMENT = 0.20


def gate_check(spec: ThroughputSpec, groups: list[LaunchGroup]) -> CheckSpec:
    """The gate of a throughput run launched as ``groups``: one group holds every block position
    (the arms share processes), more are one launch per block position (harness/throughput.py)."""
    return CheckSpec(KIND, KIND, tuple(dict.fromkeys((spec.a, spec.b))), options={"separate": len(groups) > 1})


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    raise v.error(f"{dotted}.kind", "the throughput gate is not a [[checks]] entry: it is the [throughput] table")


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [judge_throughput(suite.throughput, records, check.options["separate"])]


def _ratio_dict(result: PairedRatio, ratios: list[float]) -> dict:
    return {
        "ratio": result.ratio,
        "low": result.low,
        "high": result.high,
        "confidence": result.confidence,
        "blocks": result.blocks,
        "per_block_ratios": ratios,
        "sequence": [dataclasses.asdict(interval) for interval in result.sequence],
        "noisy": result.noisy,
    }


def _arm_medians(rows: list[dict], spec: ThroughputSpec) -> dict[str, dict]:
    """Per copy of the main series: median step time and tokens/s, and the peak memory seen."""
    labels = {"A": spec.a, "B": spec.b if spec.b != spec.a else f"{spec.b} (copy B)"}
    out = {}
    for copy, label in labels.items():
        mine = [r for r in rows if r["series"] == "main" and r["copy"] == copy]
        if mine:
            out[label] = {
                "step_time_s": statistics.median(r["step_time_s"] for r in mine),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in mine),
            }
    return out


def judge_throughput(spec: ThroughputSpec, records: RunRecords, separate: bool) -> CheckResult:
    """The gate's check, from the block rows the ranks recorded (``records.throughput``; ``separate``:
    each block position was a launch of its own); its ``extra["throughput"]`` is what summary.json
    shows as ``throughput``."""
    threshold = 1 + spec.max_slowdown
    rows, unreadable = records.throughput, records.throughput_error
    summary = {
        "a": spec.a,
        "b": spec.b,
        "mode": "separate-launches" if separate else "shared-processes",
        "blocks": spec.blocks,
        "block_rule": f"auto: at most {spec.max_blocks} blocks, {spec.budget_s:g} s" if spec.adaptive else "fixed",
        "steps": spec.steps,
        "warmup": spec.warmup,
        "timing": rows[0]["timing"] if rows else None,
        "max_slowdown": spec.max_slowdown,
        "threshold": threshold,
        "arms": _arm_medians(rows, spec),
        "control": None,
        "verdict": "error",
        "improvement": False,
    }
    name = f"throughput: {spec.b} vs {spec.a}"
    roles, times, ratios = whole_blocks(rows, "main")
    if len(ratios) < 2:
        why = unreadable or (
            f"{len(ratios)} complete ABBA block(s) of {spec.planned_blocks} recorded; an interval needs 2"
        )
        summary["headline"] = f"not judged: {why}"
        return _gate(name, "error", summary)
    main = paired_ratio(roles, times)
    noise = {role: relative_iqr([t for r, t in zip(roles, times) if r == role]) for role in "AB"}
    stopped = stop_reason(spec, rows) or f"cut short after {main.blocks} of {spec.planned_blocks} blocks"
    summary.update(_ratio_dict(main, ratios), noise=noise, stopped=stopped, measuring_s=measuring_seconds(rows))
    status = gate_verdict(main.low, main.high, threshold)
    more = "a larger --max-blocks or --budget-s" if spec.adaptive else "more blocks (--blocks K or auto)"
    words = {
        "pass": f"not slower beyond {spec.max_slowdown:.0%} (upper bound {main.high:.4f} <= {threshold:.4f})",
        "fail": f"slower beyond {spec.max_slowdown:.0%} with confidence (lower bound {main.low:.4f} > {threshold:.4f})",
        "inconclusive": f"the interval straddles {threshold:.4f}: rerun with {more}",
    }
    notes = []
    if spec.control:
        c_roles, c_times, c_ratios = whole_blocks(rows, "control")
        if len(c_ratios) >= 2:
            control = paired_ratio(c_roles, c_times)
            summary["control"] = _ratio_dict(control, c_ratios)
            notes.append(f"A/A control {control.ratio:.4f} [{control.low:.4f}, {control.high:.4f}]")
            if status != "inconclusive" and (control.low > threshold or control.high < 1 / threshold):
                status = "inconclusive"
                words[status] = f"the A/A control itself lies beyond {threshold:.4f}: the machine is too noisy"
    summary["improvement"] = main.ratio < 1 / (1 + IMPROVEMENT)  # the report and console say so
    if main.noisy:
        notes.append("noisy: IQR/median > 10% in an arm")
    summary["verdict"] = status
    summary["headline"] = "; ".join(
        [f"{spec.b}/{spec.a} step time {main.ratio:.4f} [{main.low:.4f}, {main.high:.4f}] {main.confidence:.0%}"
         f" interval over {main.blocks} ABBA blocks: {words[status]}", f"stopped: {stopped}", *notes]
    )  # fmt: skip
    return _gate(name, status, summary)


def _gate(name: str, status: str, summary: dict) -> CheckResult:
    arms = [summary["a"], summary["b"]]
    return CheckResult(name, "throughput", status, summary["headline"], extra={"throughput": summary}, arms=arms)


register(CheckFamily((KIND,), parse, run, reads=(METRICS,), listed=False))
