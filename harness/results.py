"""What a check says, in the words every part of the harness shares: :class:`CheckResult`, its
statuses and its labels.

The check families make results, verdict.py adds them up, and the reports show them; all three
read the vocabulary here, so none of them imports another to know what a status or a label means.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Worst first. "inconclusive": a gate whose interval straddles its threshold; "xfail": a check that
# failed as its negative suite expects.
STATUSES = ("error", "fail", "inconclusive", "xfail", "pass", "skip")
# The verdict of a negative suite that failed exactly as it should; it exits 0.
FAILED_AS_EXPECTED = "failed-as-expected"
# A rank refused its input (a checkpoint that must not be loaded): a check's kind, and the run's verdict.
BAD_INPUT = "bad-input"
NOT_EVALUATED = "not_evaluated"  # CheckResult.extra key: the arm, never run, that left a check unjudged
DRIFT = "drift"  # CheckResult.label: the environment, not the code, moved the numbers
REGRESSION = "regression"  # CheckResult.label of any other failure; a rank failure the code under test caused
CHANGE = "change"  # CheckResult.label: a change check (--base) failed: head moved the numbers against base
BASE_FAILS = "base"  # CheckResult.label: a suite's check fails at a change's head and at its base alike


@dataclass
class CheckResult:
    """The outcome of one check, as summary.json, the reports and the CI exit code see it."""

    name: str
    kind: str
    status: str  # one of STATUSES
    detail: str
    first_divergent_step: int | None = None
    values: dict | None = None  # both values at first_divergent_step, keyed by arm label
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    extra: dict = field(default_factory=dict)
    arms: list[str] = field(default_factory=list)  # the arms it judges; the report groups checks by them
    label: str | None = (
        None  # what a failure means: DRIFT, CHANGE, BASE_FAILS or REGRESSION (verdict.py); None unless it failed
    )

    def to_dict(self) -> dict:
        """JSON-ready: numpy scalars become Python ones; floats are kept unrounded."""
        return _plain(dataclasses.asdict(self))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
