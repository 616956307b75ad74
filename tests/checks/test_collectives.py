"""The collectives of a traced torchtitan step (harness/checks/collectives.py), on graphs shaped as
torchtitan 0.3.0's graph chunking traces them at ``layers.*`` (two MoE layers, two chunks): each
check passes on the graph as traced and fails on the bug it exists for."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from harness.checks.collectives import arm_collectives, same_collectives
from harness.records import ArmRecords, RunRecords
from harness.subject.protocol import ArmFacts
from tests.suite_files import suite_from

ROOTS = ("layers.1", "layers.2")


def _traced() -> list[dict]:
    """Per MoE layer and chunk: forward two dispatch all-to-alls (counts, tokens) and a combine,
    backward one of each; per module with parameters: an all-gather each way and a reduce-scatter."""
    nodes: list[dict] = []

    def add(op: str, module: str, phase: str, region: str | None = None, chunk: int | None = None, role=None):
        nodes.append(
            {
                "name": f"n{len(nodes)}",
                "op": op,
                "phase": phase,
                "module": module,
                "region": region,
                "chunk": chunk,
                "role": role,
                "waited": True,
            }
        )

    for module in ("layers.0.attention.wq_a", "layers.1.moe.router.gate", "norm"):
        add("all_gather_into_tensor", module, "fwd")
        add("all_gather_into_tensor", module, "bwd")
        add("reduce_scatter_tensor", module, "bwd")
    for root in ROOTS:
        experts = f"{root}.moe.routed_experts"
        for chunk in (0, 1):
            for phase, dispatches in (("fwd", 2), ("bwd", 1)):
                for _ in range(dispatches):
                    add("all_to_all_single", experts, phase, root, chunk, "dispatch")
                add("all_to_all_single", experts, phase, root, chunk, "combine")
    return nodes


def _records(collectives: list[dict], roots: tuple[str, ...] = ROOTS) -> ArmRecords:
    return ArmRecords(facts=ArmFacts(chunk_roots=roots, chunks=2), graph={"collectives": collectives})


def test_the_graph_as_traced_passes() -> None:
    result = arm_collectives("graph: graph-collectives", _records(_traced()))
    assert result.status == "pass", result.detail
    assert result.detail.startswith("29 collectives, every one waited; 20 all-to-alls, the same in each of 2")
    # Eager chunking reduces each chunk's gradients apart: once per chunk, as torchtitan traces it.
    per_chunk = _traced()
    per_chunk += [{**c, "name": f"{c['name']}-1"} for c in per_chunk if c["op"] == "reduce_scatter_tensor"]
    assert arm_collectives("eager-traced: graph-collectives", _records(per_chunk)).status == "pass"


@pytest.mark.parametrize(
    "bug, message",
    [
        ("unwaited", "all_to_all_single n9 (layers.1.moe.routed_experts, fwd) is never waited on"),
        ("chunk lost its exchange", "chunk root layers.2, chunk 1: no all-to-all"),
        ("one dispatch too many", "chunk root layers.1, chunk 1: all-to-alls bwd combine: 1, bwd dispatch: 2, fwd"),
        ("outside the roots", "runs outside every chunk root"),
        ("gradient never reduced", "module norm: all-gathered in forward, its gradient reduce-scattered 0 times"),
        ("gradient reduced thrice", "module norm: all-gathered in forward, its gradient reduce-scattered 3 times"),
    ],
)
def test_each_bug_fails_naming_what_it_broke(bug: str, message: str) -> None:
    collectives = _traced()
    exchanges = [c for c in collectives if c["op"] == "all_to_all_single"]
    if bug == "unwaited":
        exchanges[0]["waited"] = False
    elif bug == "chunk lost its exchange":
        collectives = [c for c in collectives if (c.get("region"), c.get("chunk")) != ("layers.2", 1)]
    elif bug == "one dispatch too many":
        collectives.append({**exchanges[6], "name": "extra", "phase": "bwd"})
    elif bug == "outside the roots":
        exchanges[0]["region"] = None
    elif bug == "gradient never reduced":
        collectives = [c for c in collectives if (c["op"], c["module"]) != ("reduce_scatter_tensor", "norm")]
    else:
        reduced = next(c for c in collectives if (c["op"], c["module"]) == ("reduce_scatter_tensor", "norm"))
        collectives += [{**reduced, "name": f"again{i}"} for i in range(2)]
    result = arm_collectives("graph: graph-collectives", _records(collectives))
    assert result.status == "fail" and message in result.detail, result.detail


def test_nothing_passes_on_absent_collectives() -> None:
    assert arm_collectives("x", ArmRecords(graph=None)).status == "fail"
    assert "lists no collectives" in arm_collectives("x", _records([])).detail


def test_two_arms_issue_the_same_collectives_or_fail_naming_the_difference() -> None:
    eager = _traced()
    records = RunRecords({"eager-traced": _records(eager), "graph": _records(copy.deepcopy(eager))})
    same = same_collectives("eager-traced vs graph: collectives", "eager-traced", "graph", records)
    assert (same.status, same.detail) == ("pass", "the same 29 collectives, module by module")
    unchunked = [c for c in eager if not (c["op"] == "all_to_all_single" and c["chunk"] == 1)]
    records = RunRecords({"eager-traced": _records(eager), "graph": _records(unchunked)})
    differ = same_collectives("eager-traced vs graph: collectives", "eager-traced", "graph", records)
    assert differ.status == "fail"
    assert differ.detail.startswith("only eager-traced issues 1 x all_to_all_single in layers.1.moe.routed_experts")


def test_a_suite_may_ask_it_only_of_traced_arms(tmp_path: Path) -> None:
    text = """
name = "t"
description = "x"
subject = "torchtitan"
ranks = 2
steps = 1
[train]
trainer = "graph"
[arms.eager]
chunking = "eager"
[arms.graph]
chunking = "graph"
[[checks]]
kind = "graph-collectives"
{arms}
"""
    assert suite_from(tmp_path, text.format(arms="")).checks[0].arms == ("graph",)
    with pytest.raises(Exception, match='checks.0.arms.0: arm "eager" exports no traced step'):
        suite_from(tmp_path, text.format(arms='arms = ["eager", "graph"]'))
