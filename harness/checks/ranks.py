"""``ranks-agree``: every logical rank of an arm saw the same step and holds the same replicas.

Data parallelism keeps one replica of the dense weights per logical rank and relies on every rank
applying the same update: a gradient reduced in a different order on one rank, a skipped or
doubled update, or a weight written by one rank only makes that replica drift silently, while the
loss, all-gathered, still looks right. Each logical rank records its own view of the step's loss
and grad norm every step and a hash of its replicated parameters every few steps and at the last
(``ranks.rank<k>.jsonl``, see :mod:`harness.digests`); this check demands they be bitwise equal on
all logical ranks, and names the first step, the field and the ranks that differ.
"""

from __future__ import annotations

import struct
from typing import Any

from harness.checks.registry import CheckFamily, arm_list, register
from harness.compare import format_steps
from harness.records import RankLine, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import RANK_UPDATES, SuiteReader

KIND = "ranks-agree"
FIELDS = ("loss", "grad_norm", "replicated_hash")


def _bits(value: Any) -> Any:
    """Floats by their bits (NaN equals itself, -0.0 differs from 0.0); anything else as it is."""
    return struct.pack("<d", value) if isinstance(value, float) else value


def _shown(value: Any) -> str:
    return "nothing" if value is None else repr(value)


def _disagreement(step: int, field: str, values: dict[int, Any]) -> str | None:
    """Which ranks hold another value than the lowest rank, or None when all agree."""
    first = min(values)
    differ = [r for r, v in values.items() if _bits(v) != _bits(values[first])]
    if not differ:
        return None
    ranks = ", ".join(str(r) for r in differ)
    shown = ", ".join(f"rank {r}: {_shown(values[r])}" for r in [first, *differ[:3]])
    return f"step {step}: {field} differs on logical rank {ranks} from logical rank {first} ({shown})"


def check_ranks_agree(name: str, ranks: dict[int, list[RankLine]]) -> CheckResult:
    """Every logical rank recorded the same steps, and the same loss, grad norm and replicated
    hash at each; no records, or no hash at all, fail."""
    silent = sorted(r for r, records in ranks.items() if not records)
    if not ranks or len(silent) == len(ranks):
        return CheckResult(name, KIND, "fail", "no per-rank records (ranks.rank<k>.jsonl): nothing to compare")
    if silent:
        listed = ", ".join(map(str, silent))
        return CheckResult(name, KIND, "fail", f"logical rank {listed} recorded nothing (ranks.rank<k>.jsonl)")
    by_step = {r: {rec.step: rec for rec in records} for r, records in ranks.items()}
    all_steps = sorted(set().union(*by_step.values()))
    for r, steps in by_step.items():
        missing = sorted(set(all_steps) - steps.keys())
        if missing:
            detail = f"logical rank {r} is missing steps {format_steps(missing)} that other logical ranks recorded"
            return CheckResult(name, KIND, "fail", detail, first_divergent_step=missing[0])
    problems = [
        (step, problem)
        for step in all_steps
        for field in FIELDS
        if (problem := _disagreement(step, field, {r: getattr(by_step[r][step], field) for r in by_step}))
    ]
    if problems:
        step, first = problems[0]
        bad_steps = sorted({s for s, _ in problems})
        more = f" (differences at {len(bad_steps)} steps: {format_steps(bad_steps)})" if len(bad_steps) > 1 else ""
        extra = {"problems": [p for _, p in problems[:20]], "problem_count": len(problems)}
        return CheckResult(name, KIND, "fail", first + more, first_divergent_step=step, extra=extra)
    hashed = [s for s in all_steps if by_step[min(by_step)][s].replicated_hash is not None]
    if not hashed:
        detail = f"no replicated-parameter hash recorded in {len(all_steps)} steps: a drifting replica would go unseen"
        return CheckResult(name, KIND, "fail", detail)
    detail = (
        f"{len(all_steps)} steps on {len(by_step)} logical ranks: loss and grad norm identical,"
        f" replicated parameters identical at steps {format_steps(hashed)}"
    )
    return CheckResult(name, KIND, "pass", detail)


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else KIND
    return CheckSpec(kind, name, arm_list(v, raw, dotted, arms))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [check_ranks_agree(f"{arm}: {check.name}", records[arm].ranks) for arm in check.arms]


register(CheckFamily((KIND,), parse, run, reads=(RANK_UPDATES,)))
