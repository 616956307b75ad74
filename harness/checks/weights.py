"""Two arms' final weights, bit for bit.

The loss and grad norm of an update see only the weights of earlier updates, so the last update of
a run (the last ``delay`` of a delayed pipeline, whose forwards ran before them) leaves no trace in
the metrics. After its last update every rank records a blake2b hash of each parameter of each logical
rank it hosts (``arms/<arm>/weights.rank<k>.json``, see :mod:`harness.rank.train`). ``final-weights``
passes when both arms recorded them for every logical rank, after the same number of updates, and
every digest is the same; a missing record fails, naming the arm and the logical rank.
"""

from __future__ import annotations

from harness.checks.registry import CheckFamily, Problem, problems_result, register
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import FINAL_WEIGHTS, SuiteReader

KIND = "final-weights"
_MAX_NAMED = 3  # differing parameters named per logical rank


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    a, b = v.arm_pair(raw, dotted, arms)
    if arms[a].logical_ranks != arms[b].logical_ranks:
        raise v.error(
            f"{dotted}.arms",
            f"final weights compare logical rank by logical rank; {a} has {arms[a].logical_ranks} logical ranks,"
            f" {b} {arms[b].logical_ranks}",
        )
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else f"{a} vs {b}, final weights"
    return CheckSpec(kind, name, (a, b))


def _well_formed(weights: object) -> bool:
    return (
        isinstance(weights, dict)
        and isinstance(weights.get("updates"), int)
        and isinstance(weights.get("parameters"), dict)
        and all(isinstance(digest, str) for digest in weights["parameters"].values())
    )


def _rank_problem(rank: int, arms: tuple[str, str], recorded: tuple[dict | None, dict | None]) -> str | None:
    """Why logical rank ``rank``'s final weights are not shown identical in the two arms, or None."""
    missing = [arm for arm, weights in zip(arms, recorded) if weights is None]
    if missing:
        return f"logical rank {rank}: no final weights recorded by arm {' and '.join(missing)}"
    malformed = [arm for arm, weights in zip(arms, recorded) if not _well_formed(weights)]
    if malformed:
        return f"logical rank {rank}: malformed final weights of arm {' and '.join(malformed)}"
    (a, b), (wa, wb) = arms, recorded
    if wa["updates"] != wb["updates"]:
        return f"logical rank {rank}: {a} recorded weights after {wa['updates']} updates, {b} after {wb['updates']}"
    pa, pb = wa["parameters"], wb["parameters"]
    if pa.keys() != pb.keys():
        return f"logical rank {rank}: parameters differ in name: {sorted(pa.keys() ^ pb.keys())[:_MAX_NAMED]}"
    differing = [name for name in pa if pa[name] != pb[name]]
    if differing:
        named = ", ".join(differing[:_MAX_NAMED]) + (", ..." if len(differing) > _MAX_NAMED else "")
        return (
            f"logical rank {rank}: {len(differing)} of {len(pa)} parameters differ"
            f" after {wa['updates']} updates: {named}"
        )
    return None


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    a, b = check.arms
    ranks = range(suite.arms[a].logical_ranks)
    problems: list[Problem] = []
    for rank in ranks:
        recorded = (records[a].final_weights.get(rank), records[b].final_weights.get(rank))
        if problem := _rank_problem(rank, (a, b), recorded):
            problems.append((None, problem))
    passed = ""
    if not problems:
        first = records[a].final_weights[0]
        passed = (
            f"{len(first['parameters'])} parameters bitwise identical on all {len(ranks)} logical ranks"
            f" after {first['updates']} updates"
        )
    return [problems_result(check.name, KIND, problems, passed)]


register(CheckFamily((KIND,), parse, run, reads=(FINAL_WEIGHTS,)))
