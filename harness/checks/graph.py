"""Static checks of a traced arm's train-step graph (kind ``graph-invariants``): exchange counts,
launch/wait pairs, buffer sets and chunk order, as the arm recorded them in ``arm.json``."""

from __future__ import annotations

from harness.checks.registry import CheckFamily, SuiteReader, register
from harness.compare import CheckResult
from harness.records import ArmRecords
from harness.reference.train import TRACED
from harness.specs import ArmSpec, CheckSpec, SuiteSpec

KIND = "graph-invariants"


def _traced_arms(raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> tuple[str, ...]:
    """The arms whose graphs the check reads: those listed, or every traced arm."""
    traced = {arm for arm, spec in arms.items() if spec.train.get("chunking") in TRACED}
    chosen = (
        v.str_list(raw["arms"], f"{dotted}.arms", list(arms))
        if "arms" in raw
        else tuple(a for a in arms if a in traced)
    )
    for i, arm in enumerate(chosen):
        if arm not in traced:
            raise v.error(
                f"{dotted}.arms.{i}", f'arm "{arm}" has no graph (chunking must be one of {", ".join(TRACED)})'
            )
    if not chosen:
        raise v.error(dotted, f"needs a traced arm (chunking one of {', '.join(TRACED)}); the suite has none")
    return chosen


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else kind
    return CheckSpec(kind, name, _traced_arms(raw, dotted, v, arms))


def _arm_results(arm: str, graph_checks: list[dict]) -> list[CheckResult]:
    """The static checks the rank recorded for a traced arm's graph; none recorded is a failure."""
    if not graph_checks:
        return [CheckResult(f"{arm}: {KIND}", KIND, "fail", "the arm recorded no static graph checks")]
    return [
        CheckResult(f"{arm}: {c['name']}", KIND, c["status"], c["detail"], extra={"problems": c["problems"]})
        for c in graph_checks
    ]


def run(check: CheckSpec, suite: SuiteSpec, records: dict[str, ArmRecords]) -> list[CheckResult]:
    return [result for arm in check.arms for result in _arm_results(arm, records[arm].graph_checks)]


register(CheckFamily((KIND,), parse, run))
