"""A change check: each arm at the head revision against itself at the base (harness/change.py).

Not a ``[[checks]]`` entry: ``--base`` adds one ``change`` check per arm of the suite, at the tier of
its ``[change]`` table (``exact`` unless it says otherwise: a refactor must be bitwise). It compares
the loss and grad norm step by step at that tier, and, where the arm records them, its final
weights bit for bit when the tier is bit-level. A failure names the step and the first parameter
whose gradient parts (the digests), as ``exact`` does; the first op where the two revisions part
is the op-level re-run's (harness/first_op.py), which runs each revision's code in its own launch.
"""

from __future__ import annotations

import dataclasses

from harness.checks import pairs, weights
from harness.checks.registry import CheckFamily, register
from harness.compare import Exact, Ulp, tier_from_spec
from harness.records import RunRecords
from harness.results import CHANGE, CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import FINAL_WEIGHTS, METRICS, SuiteReader

KIND = "change"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    raise v.error(f"{dotted}.kind", "change checks are made by --base REV at the [change] table's tier")


def change_check(arm: str, base_arm: str, tier: dict) -> CheckSpec:
    """The check of ``arm`` at head against ``base_arm``, the same arm at base."""
    return CheckSpec(KIND, f"{arm}: head vs base", (base_arm, arm), pairs.DEFAULT_METRICS, tier)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    base, head = check.arms
    tier = tier_from_spec(check.tier)
    as_pair = dataclasses.replace(check, kind=tier.kind)
    results = pairs.run(as_pair, suite, records)
    if isinstance(tier, (Exact, Ulp)) and suite.arms[head].emits(FINAL_WEIGHTS):
        named = dataclasses.replace(check, name=f"{check.name}: final weights")
        results += weights.run(named, suite, records)
    label = {"fail": CHANGE}
    return [dataclasses.replace(r, kind=KIND, arms=[base, head], label=label.get(r.status)) for r in results]


register(CheckFamily((KIND,), parse, run, reads=(METRICS,), listed=False))
