"""The collectives of a traced step, judged from the ``collectives`` its arm exported in ``graph.json``.

A traced torchtitan arm (harness/subject/titan_trainer.py) lists each functional collective of its
step's graph as torchtitan's own annotations place it: op (``all_to_all_single``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``), the module that issued it,
forward or backward, its chunk and chunk region, its EP role, and whether a wait reads it. What the
graph must hold comes from the arm's facts (``chunk_roots``, ``chunks``), never from its config:

* ``graph-collectives`` (each arm): every collective is waited on (one left in flight is read before
  it lands); each chunk root exchanges tokens in every chunk, the same all-to-alls in each chunk and
  each root, per direction (a chunk that lost its exchange, a root left unchunked); no all-to-all runs
  outside the roots where the arm chunks; every module whose parameters are all-gathered in forward
  has its gradients reduce-scattered in backward, once, or once per chunk where the chunks reduce
  apart (a gradient FSDP never reduces, or reduces more often).
* ``same-collectives`` (two arms): the same collectives, module by module, direction, chunk and EP
  role: torchtitan's graph chunk pass against its eager chunking, traced.

No graph.json, or one without collectives, fails: nothing passes on absent data.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.checks.registry import CheckFamily, Problem, problems_result, qualifying_arms, register
from harness.records import ArmRecords, RunRecords
from harness.results import CheckResult
from harness.specs import ArmSpec, CheckSpec, SuiteSpec
from harness.subject.protocol import GRAPH, SuiteReader

KIND = "graph-collectives"
SAME = "same-collectives"
ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER = "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor"


def collectives_of(records: ArmRecords) -> list[dict[str, Any]] | str:
    """The arm's exported collectives, or why there are none to judge."""
    graph = records.graph
    if not isinstance(graph, dict) or not isinstance(graph.get("collectives"), list):
        return "no graph.json with a list 'collectives': the arm exported no traced step"
    if not graph["collectives"]:
        return "graph.json lists no collectives: a traced step of a distributed arm has some"
    return graph["collectives"]


def arm_collectives(name: str, records: ArmRecords) -> CheckResult:
    """One arm's collectives against its facts (the module docstring's ``graph-collectives``)."""
    collectives = collectives_of(records)
    if isinstance(collectives, str):
        return CheckResult(name, KIND, "fail", collectives)
    facts = records.facts
    roots, chunks = (facts.chunk_roots or (), facts.chunks or 1) if facts is not None else ((), 1)
    problems: list[Problem] = [
        (None, f"{c['op']} {c['name']} ({c['module']}, {c['phase']}) is never waited on")
        for c in collectives
        if not c.get("waited")
    ]
    problems += _exchanges(collectives, tuple(roots), chunks)
    problems += _fsdp(collectives, chunks)
    exchanges = sum(c["op"] == ALL_TO_ALL for c in collectives)
    passed = (
        f"{len(collectives)} collectives, every one waited; {exchanges} all-to-alls, the same in each of"
        f" {len(roots)} chunk roots x {chunks} chunks per direction; every all-gathered module reduce-scattered"
    )
    return problems_result(name, KIND, problems, passed)


def _exchanges(collectives: list[dict], roots: tuple[str, ...], chunks: int) -> list[Problem]:
    """Each root's all-to-alls: in every chunk, alike across chunks and roots; none outside the roots."""
    exchanges = [c for c in collectives if c["op"] == ALL_TO_ALL]
    if not roots:
        return []
    problems: list[Problem] = [
        (None, f"all-to-all {c['name']} ({c['module']}, {c['phase']}) runs outside every chunk root")
        for c in exchanges
        if c.get("region") not in roots
    ]
    signatures = {}
    for root in roots:
        for chunk in range(chunks):
            signature = Counter(
                (c["phase"], c.get("role")) for c in exchanges if c.get("region") == root and c.get("chunk") == chunk
            )
            if not signature:
                problems.append((None, f"chunk root {root}, chunk {chunk}: no all-to-all"))
            signatures[(root, chunk)] = signature
    first, want = next(iter(signatures.items()))
    for (root, chunk), signature in signatures.items():
        if signature and signature != want:
            got, expected = _counts(signature), _counts(want)
            problems.append(
                (None, f"chunk root {root}, chunk {chunk}: all-to-alls {got}, where {first} has {expected}")
            )
    return problems


def _counts(signature: Counter) -> str:
    return ", ".join(f"{phase} {role}: {n}" for (phase, role), n in sorted(signature.items(), key=str))


def _fsdp(collectives: list[dict], chunks: int) -> list[Problem]:
    """Every module all-gathered in forward has its gradient reduce-scattered in backward: once, or
    once per chunk where chunks reduce their gradients apart (torchtitan's eager chunking)."""
    gathered = {c["module"] for c in collectives if c["op"] == ALL_GATHER and c["phase"] == "fwd"}
    reduced = Counter(c["module"] for c in collectives if c["op"] == REDUCE_SCATTER and c["phase"] == "bwd")
    return [
        (None, f"module {module}: all-gathered in forward, its gradient reduce-scattered {reduced[module]} times")
        for module in sorted(gathered, key=str)
        if not 1 <= reduced[module] <= chunks
    ]


def same_collectives(name: str, a: str, b: str, records: RunRecords) -> CheckResult:
    """Two arms' collectives, as multisets of (op, module, direction, chunk, EP role)."""
    of = {arm: collectives_of(records[arm]) for arm in (a, b)}
    for arm, collectives in of.items():
        if isinstance(collectives, str):
            return CheckResult(name, SAME, "fail", f"{arm}: {collectives}")
    keys = {
        arm: Counter((c["op"], c["module"], c["phase"], c.get("chunk"), c.get("role")) for c in collectives)
        for arm, collectives in of.items()
    }
    only = {arm: keys[arm] - keys[other] for arm, other in ((a, b), (b, a))}
    problems: list[Problem] = [
        (None, f"only {arm} issues {n} x {op} in {module} ({phase}, chunk {chunk}, {role})")
        for arm in (a, b)
        for (op, module, phase, chunk, role), n in sorted(only[arm].items(), key=str)
    ]
    return problems_result(name, SAME, problems, f"the same {sum(keys[a].values())} collectives, module by module")


def _no_collectives(spec: ArmSpec) -> str | None:
    return None if spec.emits(GRAPH) else "exports no traced step (only a traced arm does)"


def parse(kind: str, raw: dict, dotted: str, v: SuiteReader, arms: dict[str, ArmSpec]) -> CheckSpec:
    v.table(raw, dotted, ("kind", "name", "arms"))
    if kind == SAME:
        chosen = v.arm_pair(raw, dotted, arms)
        for i, arm in enumerate(chosen):
            if reason := _no_collectives(arms[arm]):
                raise v.error(f"{dotted}.arms.{i}", f'arm "{arm}" {reason}')
    else:
        chosen = qualifying_arms(v, raw, dotted, arms, _no_collectives, "a traced arm")
    default = f"{chosen[0]} vs {chosen[1]}: collectives" if kind == SAME else kind
    name = v.check_name(raw["name"], f"{dotted}.name") if "name" in raw else default
    return CheckSpec(kind, name, tuple(chosen))


def run(check: CheckSpec, suite: SuiteSpec, records: RunRecords) -> list[CheckResult]:
    if check.kind == SAME:
        return [same_collectives(check.name, *check.arms, records)]
    return [arm_collectives(f"{arm}: {check.name}", records[arm]) for arm in check.arms]


register(CheckFamily((KIND, SAME), parse, run, reads=(GRAPH,)))
