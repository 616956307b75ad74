"""Naming the first op where two arms part: record both, compare them, and measure the first
differing outputs.

The first pass records every op of both arms. It keeps only hashes and small statistics, because
until the two sequences are compared nobody knows which op to keep. Once the first differing pair
is known, a second pass re-runs each arm from the start and clones only that op's outputs; their
difference is then measured exactly. The arms are deterministic (the harness checks that
separately), and the second pass confirms it for this op: it reports whether the captured outputs
hash as the first pass recorded (``reproduced``). A second pass costs one more run of each arm.
Keeping every op's outputs in the first pass would cost memory in proportion to the whole run.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from harness.op_divergence.compare import compare_ops, describe
from harness.op_divergence.record import OpRecord, OpRecorder, content_digest, json_float

# Runs one arm's steps from a fresh start, each inside the recorder it is given (entered by the run,
# around the steps alone, so that building the arm is not recorded), setting ``recorder.step`` per step.
ArmRun = Callable[[OpRecorder], None]


def record_arm(run: ArmRun, *, placeholders: Collection[str] = (), capture: int | None = None) -> OpRecorder:
    """One pass of an arm under a fresh recorder; returns the recorder, which holds what it saw."""
    recorder = OpRecorder(placeholders=placeholders, capture=capture)
    run(recorder)
    return recorder


def first_op_divergence(
    run_a: ArmRun,
    run_b: ArmRun,
    *,
    arms: tuple[str, str] = ("a", "b"),
    placeholders: Collection[str] = (),
    measure: bool = True,
) -> dict[str, Any]:
    """Where arms ``a`` and ``b`` first part, op by op, as JSON data (see :func:`describe`); with
    ``measure``, the first differing pair's outputs are compared in a second pass of each arm."""
    a = record_arm(run_a, placeholders=placeholders).records
    b = record_arm(run_b, placeholders=placeholders).records
    comparison = compare_ops(a, b)
    result = {"arms": {"a": arms[0], "b": arms[1]}, **describe(comparison)}
    if measure and comparison.pair is not None:
        i, j = comparison.pair
        result["first_difference"].update(_measure(run_a, a[i], run_b, b[j], placeholders))
    return result


def _measure(
    run_a: ArmRun, op_a: OpRecord, run_b: ArmRun, op_b: OpRecord, placeholders: Collection[str]
) -> dict[str, Any]:
    """The differing pair's outputs, captured in a second pass of each arm, and their differences."""
    out_a = record_arm(run_a, placeholders=placeholders, capture=op_a.index).captured or []
    out_b = record_arm(run_b, placeholders=placeholders, capture=op_b.index).captured or []
    return measured(op_a, out_a, op_b, out_b)


def measured(op_a: OpRecord, out_a: list[torch.Tensor], op_b: OpRecord, out_b: list[torch.Tensor]) -> dict[str, Any]:
    """The differing pair's outputs as a second pass captured them, and their differences, if they
    hash as the first pass recorded them (``reproduced``): else they are not the outputs compared."""
    reproduced = all([content_digest(t) for t in out] == list(op.hashes) for op, out in ((op_a, out_a), (op_b, out_b)))
    if not reproduced:
        return {"reproduced": False, "outputs": []}
    return {"reproduced": True, "outputs": [output_difference(x, y) for x, y in zip(out_a, out_b)]}


def output_difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """How two outputs of one shape differ: the largest absolute difference, that difference relative
    to the largest magnitude in either (elementwise ratios blow up near zero), and how many elements differ."""
    x, y = a.double(), b.double()
    diff = (x - y).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = max(float(x.abs().max()), float(y.abs().max())) if diff.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return {
        "max_abs": json_float(max_abs),
        "max_rel": json_float(max_rel),
        "elements_differing": int((x != y).sum()),
        "elements": x.numel(),
    }
