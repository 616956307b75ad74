"""Run directories of throughput runs as the contract writes them: throughput.jsonl and summary.json.

Step times are planted (A at ``a_step_s``, B at ``b_step_s``, a small repeatable wobble per block), the
statistics come from the harness's own ``paired_ratio``, and the verdict follows the documented rule,
so a report can be checked against numbers known in advance.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness.abba import BLOCK, abba_order, paired_ratio

STEPS, WARMUP, TOKENS_PER_STEP = 5, 2, 256


def measurements(series: str, arm_a: str, arm_b: str, blocks: int, a_step_s: float, b_step_s: float) -> list[dict]:
    """One throughput.jsonl row per position of each ABBA block; the control's B is A's second copy, "A2"."""
    rows = []
    for i, role in enumerate(abba_order(blocks)):
        block, position = i // len(BLOCK) + 1, i % len(BLOCK)
        step_time = (a_step_s if role == "A" else b_step_s) * (1 + 0.01 * ((block * 7 + position * 3) % 5 - 2))
        rows.append(
            {
                "series": series,
                "block": block,
                "position": position,
                "role": role,
                "copy": role if series == "main" or role == "A" else "A2",
                "arm": arm_a if role == "A" else arm_b,
                "steps": STEPS,
                "first_step": WARMUP + 1 + (block - 1) * STEPS,
                "seconds": step_time * STEPS,
                "step_time_s": step_time,
                "tokens_per_s": TOKENS_PER_STEP / step_time,
                "peak_memory_bytes": (120 if role == "A" else 150) * 2**20 + block * 2**16,
                "timing": "wall",
            }
        )
    return rows


def _statistics(rows: list[dict]) -> dict:
    stats = paired_ratio([r["role"] for r in rows], [r["step_time_s"] for r in rows])
    per_block = [
        sum(r["step_time_s"] for r in rows[i : i + 4] if r["role"] == "B")
        / sum(r["step_time_s"] for r in rows[i : i + 4] if r["role"] == "A")
        for i in range(0, len(rows), len(BLOCK))
    ]
    sequence = [dataclasses.asdict(interval) for interval in stats.sequence]
    return {"ratio": stats.ratio, "low": stats.low, "high": stats.high, "per_block_ratios": per_block,
            "sequence": sequence, "noisy": stats.noisy}  # fmt: skip


def write_throughput_run(
    run_dir: Path,
    *,
    a: str = "eager",
    b: str = "graph",
    blocks: int = 4,
    a_step_s: float = 0.08,
    b_step_s: float = 0.08,
    control: bool = False,
    mode: str = "shared-processes",
    max_slowdown: float = 0.05,
    verdict: str | None = None,
) -> dict:
    """Writes throughput.jsonl and summary.json into run_dir and returns the summary.

    ``verdict`` overrides the judged one: the gate also calls a run inconclusive when its A/A control
    lies beyond the threshold.
    """
    rows = measurements("main", a, b, blocks, a_step_s, b_step_s)
    control_rows = measurements("control", a, a, blocks, a_step_s, a_step_s * 1.002) if control else []
    main = _statistics(rows)
    threshold = 1 + max_slowdown
    judged = "pass" if main["high"] <= threshold else "fail" if main["low"] > threshold else "inconclusive"
    verdict = verdict or judged
    headline = f"{b}/{a} step time = {main['ratio']:.3f} [{main['low']:.3f}, {main['high']:.3f}] ({verdict})"
    throughput = {
        "a": a,
        "b": b,
        "mode": mode,
        "blocks": blocks,
        "steps": STEPS,
        "warmup": WARMUP,
        "timing": "wall",
        "confidence": 0.95,
        **main,
        "noise": {"A": 0.01, "B": 0.02},
        "max_slowdown": max_slowdown,
        "threshold": threshold,
        "verdict": verdict,
        "improvement": main["ratio"] < 1 / 1.2,
        "headline": headline,
        "arms": {
            arm: {"step_time_s": t, "tokens_per_s": TOKENS_PER_STEP / t, "peak_memory_bytes": mem * 2**20}
            for arm, t, mem in ((a, a_step_s, 120), (b, b_step_s, 150))
        },
        "control": _statistics(control_rows) if control else None,
    }
    exit_code = {"pass": 0, "fail": 1, "inconclusive": 4}[verdict]
    gate = {"name": f"throughput: {b} vs {a}", "kind": "throughput", "status": verdict, "detail": headline,
            "arms": [a, b], "values": {a: a_step_s, b: b_step_s}}  # fmt: skip
    summary = {
        "suite": "abba",
        "verdict": verdict,
        "exit_code": exit_code,
        "ranks": 2,
        "steps": STEPS,
        "arms": {a: {"ranks": 2}, b: {"ranks": 2}},
        "duration_s": 12.5,
        "counts": {"pass": 0, "fail": 0, "error": 0, "skip": 0, "inconclusive": 0, verdict: 1},
        "checks": [gate],
        "throughput": throughput,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + control_rows))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary
