"""``fp32-gradient-sum``: an arm's replicated gradients were summed over logical ranks in fp32.

Under ``precision = "bf16-mixed"`` the design sums gradients in fp32. A sum taken in bf16 instead
moves every arm of a suite alike, so no pairwise check sees it, and its rounding (~4e-3 of a
gradient) hides within any tolerance against an oracle that computes in bf16 itself; only a golden
would see it. So each logical rank records, every step, a hash of its replicated gradients as
summed and of every logical rank's own gradients gathered and summed again in fp32, in logical-rank
order (``ranks.rank<k>.jsonl``, :class:`~harness.records.RankLine`). This check demands the two be
bitwise equal at every step on every logical rank; a step without them fails too.
"""

from __future__ import annotations

from harness.checks.registry import CheckFamily, Problem, problems_result, qualifying_arms, register
from harness.records import RankLine, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import GRADIENT_SUM, RANK_UPDATES, SuiteReader

KIND = "fp32-gradient-sum"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``arms`` (default: every arm that records its gradient sum)."""
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else KIND
    chosen = qualifying_arms(
        v,
        raw,
        dotted,
        arms,
        lambda spec: None if spec.emits(GRADIENT_SUM) else "records no gradient sum (a bf16-mixed arm does)",
        "an arm that records its gradient sum (precision = 'bf16-mixed')",
    )
    return CheckSpec(kind, name, chosen)


def _problem(rank: int, line: RankLine) -> str | None:
    """Why logical rank ``rank``'s sum of one step is not shown to be fp32, or None."""
    if line.grad_sum_hash is None or line.grad_fp32_resum_hash is None:
        return f"step {line.step}: logical rank {rank} recorded no gradient sum and fp32 re-sum"
    if line.grad_sum_hash != line.grad_fp32_resum_hash:
        return (
            f"step {line.step}: logical rank {rank}'s replicated gradients as summed are not bitwise"
            " the fp32 sum of the logical ranks' own: summed in another precision or order"
        )
    return None


def judge(name: str, ranks: dict[int, list[RankLine]]) -> CheckResult:
    """Every recorded step of every logical rank: the sum is bitwise its fp32 re-sum."""
    lines = [(rank, line) for rank, recorded in sorted(ranks.items()) for line in recorded]
    if not lines:
        return CheckResult(name, KIND, "fail", "no per-rank records (ranks.rank<k>.jsonl): nothing compared")
    problems: list[Problem] = sorted(
        ((line.step, problem) for rank, line in lines if (problem := _problem(rank, line))), key=lambda p: p[0]
    )
    steps = len({line.step for _, line in lines})
    passed = (
        f"{steps} steps on {len(ranks)} logical ranks: the replicated gradients as summed are bitwise"
        " the fp32 sum of the logical ranks' own"
    )
    return problems_result(name, KIND, problems, passed)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    return [judge(f"{arm}: {check.name}", records[arm].ranks) for arm in check.arms]


register(CheckFamily((KIND,), parse, run, reads=(RANK_UPDATES, GRADIENT_SUM)))
