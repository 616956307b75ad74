"""``resume``: a run stopped and resumed by a fresh launch trains bit for bit as one that never stopped.

The pair is an arm that trains every step in one launch and an arm with ``resume_at = k``, whose
first launch trains steps 1..k and saves a checkpoint, and whose second, a fresh set of processes
(perhaps of another count: ``resume_ranks``), loads it and trains k+1 onwards. First the resumed
arm must show it really loaded the checkpoint of step k (its ``arm.json`` from the second launch
records ``resumed_from``): a resume that silently started over would otherwise compare a fresh run
with itself. Then its loss and grad norm must equal the straight arm's at every step, bit for bit;
a failure names the first differing step and, from the gradient digests, the first parameter whose
gradient differs there. Steps up to k only check the first launch; the last weights are
``final-weights``'s.

The two arms must train alike: they may differ only in fields that change how an arm keeps its
state, never what it computes (the fields its subject lists in ``ArmFacts.how_only``), so that one
straight arm serves several resumed ones and a suite pays for its straight run once. The
reference's:

- ``retention`` (versioned arms): whether a pending forward keeps its graph, offloads its saved
  tensors or is replayed. The ``retention`` suite holds the three to bitwise equal loss, grad norm
  and gradients at every step; and a resumed arm's restored forwards replay under every retention
  anyway. A resumed ``offload`` arm equal to a straight ``retain`` one is then equal to a straight
  ``offload`` one.
- ``checkpoint_fault``: a planted checkpoint bug acts only in a save or a load, which a straight
  arm never runs.
"""

from __future__ import annotations

import dataclasses

from harness.checks.pairs import localised
from harness.checks.registry import CheckFamily, register
from harness.compare import Exact, compare_arms
from harness.digests import first_divergence
from harness.records import RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import GRADIENT_DIGESTS, METRICS, SuiteReader

KIND = "resume"
METRIC_NAMES = ("loss", "grad_norm")


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    """``arms``: the straight arm, then the resumed one (``resume_at`` set); ``metrics``."""
    v.table(raw, dotted, ("kind", "name", "arms", "metrics"))
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else None
    straight, resumed = v.arm_pair(raw, dotted, arms)
    if arms[straight].resume_at is not None:
        raise v.error(f"{dotted}.arms.0", f'arm "{straight}" resumes (resume_at): the first arm trains straight')
    if arms[resumed].resume_at is None:
        raise v.error(f"{dotted}.arms.1", f'arm "{resumed}" never stops: set resume_at on it')
    ours, theirs = arms[straight].train, arms[resumed].train
    how_only = set(arms[straight].facts.how_only) | set(arms[resumed].facts.how_only)  # see the module docstring
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k) and k not in how_only)
    if differ:
        raise v.error(f"{dotted}.arms", f"the two arms train differently ({', '.join(differ)}): nothing to owe")
    metrics = v.metric_list(raw, dotted, METRIC_NAMES)
    return CheckSpec(kind, name or f"{straight} vs {resumed}", (straight, resumed), metrics)


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    straight, resumed = check.arms
    at = suite.arms[resumed].resume_at
    loaded = records[resumed].facts.resumed_from if records[resumed].facts is not None else None
    if loaded != at:
        detail = (
            f"arm {resumed} did not resume from its checkpoint of step {at}"
            f" (arm.json records resumed_from {loaded!r}): nothing compared"
        )
        return [CheckResult(f"{check.name}: resumed", KIND, "fail", detail)]
    results = [_compare(f"{check.name}: {metric}", metric, records, straight, resumed) for metric in check.metrics]
    if any(r.status == "fail" for r in results):
        results = localised(
            results, first_divergence(records[straight].digests, records[resumed].digests, straight, resumed)
        )
    resumed_line = f"{resumed} loaded its checkpoint of step {at} in a fresh launch"
    return [CheckResult(f"{check.name}: resumed", KIND, "pass", resumed_line), *results]


def _compare(name: str, metric: str, records: RunRecords, straight: str, resumed: str) -> CheckResult:
    """The metric bit for bit, failing at the first differing step: a value that differs comes
    before the steps a resumed arm lacks. A pipeline whose checkpoint lost a pending forward makes one
    update fewer, so it also ends short; the comparison of the whole runs would report only the
    missing last step, where the news is the first update that differs."""
    ours, theirs = records[straight].metrics, records[resumed].metrics
    whole = compare_arms(name, ours, theirs, metric, Exact(), straight, resumed)
    common = ours.index.intersection(theirs.index)
    shared = compare_arms(name, ours.loc[common], theirs.loc[common], metric, Exact(), straight, resumed)
    first, first_shared = whole.first_divergent_step, shared.first_divergent_step
    if None not in (first, first_shared) and first_shared < first:
        whole = dataclasses.replace(shared, detail=f"{shared.detail}; and {whole.detail}")
    return dataclasses.replace(whole, kind=KIND)


register(CheckFamily((KIND,), parse, run, reads=(METRICS, GRADIENT_DIGESTS)))
