"""The registry of check families, and the one entry point that runs a suite's [[checks]].

A family owns some ``kind`` strings of the suite format: it parses their tables into
:class:`~harness.specs.CheckSpec` and judges an arm's records with them. Each family is one module
of this package that ends with ``register(CheckFamily(...))``; the suite validator and the run
only ever go through :data:`FAMILIES`, so a new family is one module and its tests.

Checks run on partial records too: an arm that stopped early then fails every check that needs
its missing steps. Nothing passes on absent data: every family fails a check whose records are
missing (no events, no MoE layers, no graph), and an arm whose records cannot be read makes
every check reading it an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import METRICS, SuiteReader

# (kind, the [[checks]] table, its dotted path such as "checks.3", the validator, the suite's arms)
Parse = Callable[[str, dict, str, SuiteReader, dict[str, ArmSpec]], CheckSpec]
# (the check, the suite, what the run recorded: each arm's records by name, and the run's own)
Run = Callable[[CheckSpec, SuiteSpec, RunRecords], list[CheckResult]]


@dataclass(frozen=True)
class CheckFamily:
    """The kinds one module owns, how their tables parse, how their checks judge records, and the
    record families (harness/subject/protocol.py) they read: one tuple for every kind, or a tuple
    per kind. A suite whose subject or arm cannot emit what a check reads is refused at load."""

    kinds: tuple[str, ...]
    parse: Parse
    run: Run
    reads: tuple[str, ...] | Mapping[str, tuple[str, ...]] = (METRICS,)
    listed: bool = True  # False: every run has it and no suite lists it (golden, the throughput gate)

    def reads_of(self, kind: str) -> tuple[str, ...]:
        return self.reads[kind] if isinstance(self.reads, Mapping) else self.reads


FAMILIES: dict[str, CheckFamily] = {}
Problem = tuple[int | None, str]  # (step or None, message), in the order found
_MAX_LISTED = 20


def register(family: CheckFamily) -> CheckFamily:
    """Makes the family's kinds known to suites and runs; a kind has exactly one owner."""
    for kind in family.kinds:
        if kind in FAMILIES:
            raise ValueError(f"check kind {kind!r} is registered twice")
        FAMILIES[kind] = family
    return family


def run_check(check: CheckSpec, suite: SuiteSpec, records: Mapping[str, ArmRecords]) -> list[CheckResult]:
    """The results of one check, each naming the arms it judges; an arm whose records cannot be
    read makes it an error. ``records``: a RunRecords, or any mapping of arm records."""
    if not isinstance(records, RunRecords):
        records = RunRecords(dict(records))
    unreadable = [records[arm].error for arm in check.arms if arm in records and records[arm].error]
    if unreadable:
        return [CheckResult(check.name, check.kind, "error", f"not run: {'; '.join(unreadable)}", arms=[*check.arms])]
    return [_with_arms(result, check.arms) for result in FAMILIES[check.kind].run(check, suite, records)]


def _with_arms(result: CheckResult, arms: tuple[str, ...]) -> CheckResult:
    """The result with its arms, where its family did not set them: the one arm its name starts
    with (single-arm families name each arm's result "<arm>: ..."), or else every arm of the check."""
    if result.arms:
        return result
    leading = [arm for arm in arms if result.name.startswith(f"{arm}: ")]
    return replace(result, arms=leading[:1] or [*arms])


def arm_list(v: SuiteReader, raw: dict, dotted: str, arms: dict[str, ArmSpec]) -> tuple[str, ...]:
    """The arms a single-arm check reads: those listed under ``arms``, or every arm of the suite."""
    return v.str_list(raw["arms"], f"{dotted}.arms", list(arms)) if "arms" in raw else tuple(arms)


def qualifying_arms(
    v: SuiteReader,
    raw: dict,
    dotted: str,
    arms: dict[str, ArmSpec],
    problem: Callable[[ArmSpec], str | None],
    wanted: str,
) -> tuple[str, ...]:
    """The arms a check reads: those listed under ``arms``, each of which must qualify (``problem``
    says why one does not), or else every arm that qualifies; ``wanted`` names one when none does."""
    if "arms" not in raw:
        chosen = tuple(arm for arm, spec in arms.items() if problem(spec) is None)
        if not chosen:
            raise v.error(dotted, f"needs {wanted}; the suite has none")
        return chosen
    chosen = v.str_list(raw["arms"], f"{dotted}.arms", list(arms))
    for i, arm in enumerate(chosen):
        if reason := problem(arms[arm]):
            raise v.error(f"{dotted}.arms.{i}", f'arm "{arm}" {reason}')
    return chosen


def problems_result(
    name: str, kind: str, problems: list[Problem], passed: str, extra: dict | None = None
) -> CheckResult:
    """Pass with ``passed`` as the detail, or fail on the first problem, counting the rest and
    listing up to 20 of them in ``extra["problems"]``."""
    if not problems:
        return CheckResult(name, kind, "pass", passed, extra=extra or {})
    step, message = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    listed = {"problems": [m for _, m in problems[:_MAX_LISTED]], "problem_count": len(problems)}
    return CheckResult(name, kind, "fail", message + more, first_divergent_step=step, extra={**(extra or {}), **listed})
