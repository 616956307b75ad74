"""graph-invariants judged by the harness from the graph.json a traced arm exported, one rule at a
time on hand-made graphs, and never from the verdicts the system under test computes itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from exported_graphs import OVERLAPPED, arm_facts, exported_graph
from suite_files import suite_from

from harness.checks import run_check
from harness.checks.graph import (
    check_buffer_sets,
    check_chunk_order,
    check_exchange_counts,
    check_launch_wait_pairs,
    expected_regions,
    read_graph,
)
from harness.records import ArmRecords, read_arm
from harness.results import CheckResult
from harness.suites import SuiteError

ROOTS = ["model.layers.1.mlp", "model.layers.2.mlp"]
REGIONS = expected_regions(list(arm_facts([1, 2]).chunk_roots))  # (root, direction) x 2 MoE layers
SUITE = """
name = "mini"
description = "a traced arm"
ranks = 2
steps = 1
[train]
routing = "forced-balanced"
chunks = 2
[arms.eager]
chunking = "eager"
[arms.graph]
chunking = "graph"
[[checks]]
kind = "graph-invariants"
"""


def _judge(tmp_path: Path, graph: dict | None, moe_layers: list[int] | None = [1, 2]) -> dict[str, CheckResult]:
    suite = suite_from(tmp_path, SUITE)
    records = {"eager": ArmRecords(), "graph": ArmRecords(facts=arm_facts(moe_layers), graph=graph)}
    return {r.name: r for r in run_check(suite.checks[0], suite, records)}


def _without(graph: dict, *names: str) -> dict:
    return {"nodes": [n for n in graph["nodes"] if n["name"] not in names]}


def _edited(graph: dict, name: str, **fields: object) -> dict:
    return {"nodes": [{**n, **fields} if n["name"] == name else n for n in graph["nodes"]]}


def test_a_scheduled_chunked_graph_passes_all_four_checks(tmp_path: Path) -> None:
    results = _judge(tmp_path, exported_graph())
    assert {name: r.status for name, r in results.items()} == {
        "graph: graph:exchange-counts": "pass",
        "graph: graph:launch-wait-pairs": "pass",
        "graph: graph:buffer-sets": "pass",
        "graph: graph:chunk-order": "pass",
    }
    assert results["graph: graph:exchange-counts"].detail == "32 launches and waits as expected (2 chunks)"
    assert results["graph: graph:buffer-sets"].detail == "4 regions alternate 2 buffer sets, none reused in flight"


def test_no_graph_json_or_an_empty_one_fails_and_a_malformed_one_is_an_error(tmp_path: Path) -> None:
    [missing] = _judge(tmp_path, None).values()
    assert (missing.name, missing.status) == ("graph: graph-invariants", "fail")
    assert missing.detail == "arm 'graph' exported no graph.json: no graph to check"
    [empty] = _judge(tmp_path, {"nodes": []}).values()
    assert empty.status == "fail" and empty.detail == "graph.json of arm 'graph' lists no launch or wait"
    [malformed] = _judge(tmp_path, _edited(exported_graph(), "dispatch_l1_c0", buffer_set="0")).values()
    assert malformed.status == "error"
    assert malformed.detail == "malformed graph.json of arm 'graph': node 0: 'buffer_set' must be int, got '0'"


def test_a_region_cloned_only_partly_fails_the_exchange_counts() -> None:
    graph = exported_graph()
    bwd_chunk_1 = [n["name"] for n in graph["nodes"] if n["phase"] == "bwd" and n["chunk"] == 1 and "l1" in n["name"]]
    counts = check_exchange_counts(read_graph(_without(graph, *bwd_chunk_1)), roots=ROOTS, chunks=2)
    assert counts.status == "fail"
    assert counts.detail == "model.layers.1.mlp bwd chunk 1: 0 combine_data (expected 1) (and 3 more)"
    unchunked = {"nodes": [{**n, "chunk": None} for n in graph["nodes"]]}
    counts = check_exchange_counts(read_graph(unchunked), roots=ROOTS, chunks=2)
    assert "model.layers.1.mlp bwd: 2 combine_data (expected 0)" in counts.extra["problems"]


def test_exchange_counts_expect_every_recorded_moe_layer_under_its_chunk_root(tmp_path: Path) -> None:
    counts = _judge(tmp_path, exported_graph(), moe_layers=[1, 2, 3])["graph: graph:exchange-counts"]
    assert counts.status == "fail" and counts.detail.startswith("model.layers.3.mlp bwd chunk 0: 0 combine_data")
    blocks = check_exchange_counts(read_graph(exported_graph(root="model.layers.{layer}")), roots=ROOTS, chunks=2)
    assert blocks.status == "fail"  # the block roots' exchanges, where MoE roots were expected
    unknown = _judge(tmp_path, exported_graph(), moe_layers=None)["graph: graph:exchange-counts"]
    assert unknown.status == "fail" and "has no arm.json with its chunk roots" in unknown.detail


def test_a_lost_a_misplaced_and_a_stray_wait_fail_launch_wait_pairs() -> None:
    graph = exported_graph()
    lost = check_launch_wait_pairs(read_graph(_without(graph, "wait_dispatch_l1_c0")))
    assert lost.detail == "launch dispatch_l1_c0 has 0 waits among its users ['wait_dispatch_l1_c0']"
    early = check_launch_wait_pairs(read_graph(_edited(graph, "wait_dispatch_l1_c0", order=0)))
    assert early.detail == "wait wait_dispatch_l1_c0 comes before its launch dispatch_l1_c0"
    stray = check_launch_wait_pairs(read_graph(_edited(graph, "wait_combine_l2_c1", consumes="mul_3")))
    assert stray.status == "fail" and stray.detail == "wait wait_combine_l2_c1 does not consume a launch"


def test_repeated_buffer_sets_fail_the_buffer_set_check() -> None:
    one_region = [n for n in exported_graph()["nodes"] if n["region"] == "model.layers.1.mlp" and n["phase"] == "fwd"]
    repeated = {"nodes": [{**n, "buffer_set": 0} for n in one_region]}
    result = check_buffer_sets(read_graph(repeated), num_buffer_sets=2, regions={"model.layers.1.mlp fwd"})
    assert result.status == "fail"
    problems = result.extra["problems"]
    assert problems[0] == "dispatch_l1_c1 of chunk 1 uses buffer set 0, expected 1"
    assert "dispatch_l1_c1 launches into dispatch buffer set 0 while dispatch_l1_c0 is in flight" in problems
    assert "model.layers.1.mlp fwd: chunks 0 and 1 both use buffer sets [0]" in problems


def test_an_exchange_outside_every_chunk_body_fails_the_buffer_set_check() -> None:
    stray = _edited(exported_graph(), "combine_l2_c0", chunk=None)
    result = check_buffer_sets(read_graph(stray), num_buffer_sets=2, regions=REGIONS)
    assert result.detail.startswith("combine_l2_c0 is not in a chunk body (buffer set 0)")


def test_backward_chunks_in_forward_order_fail_the_chunk_order() -> None:
    result = check_chunk_order(read_graph(exported_graph(OVERLAPPED, backward_ascending=True)), REGIONS)
    assert result.status == "fail"
    assert result.detail == "model.layers.1.mlp bwd: chunks launch in order [0, 1], expected [1, 0] (and 1 more)"


def test_every_graph_check_fails_when_the_backward_merged_into_the_forward_regions(tmp_path: Path) -> None:
    """A graph whose backward flag was lost (as once from cached graphs): forward and backward of each
    layer are judged as one region, 2 of the 4 the config implies. Each per-region check must fail,
    not pass on regions that happen to look ordered."""
    merged = {"nodes": [{**n, "phase": "fwd"} for n in exported_graph()["nodes"]]}
    results = _judge(tmp_path, merged)
    missing = (
        "judged 2 regions where the config implies 4; missing ['model.layers.1.mlp bwd', 'model.layers.2.mlp bwd']"
    )
    for check in ("graph:buffer-sets", "graph:chunk-order"):
        assert results[f"graph: {check}"].status == "fail"
        assert results[f"graph: {check}"].detail.startswith(missing), results[f"graph: {check}"].detail
    assert results["graph: graph:exchange-counts"].status == "fail"
    layers = _judge(tmp_path, exported_graph(), moe_layers=[1, 2, 3])  # a MoE layer with no exchange at all
    assert "missing ['model.layers.3.mlp bwd', 'model.layers.3.mlp fwd']" in layers["graph: graph:chunk-order"].detail


def test_the_verdicts_the_reference_writes_are_not_read(tmp_path: Path) -> None:
    """A system under test that certifies its own graph is still judged from the graph it exported."""
    arm_dir = tmp_path / "run" / "arms" / "graph"
    arm_dir.mkdir(parents=True)
    verdicts = [{"name": "graph:buffer-sets", "status": "pass", "detail": "fine", "problems": []}]
    (arm_dir / "arm.json").write_text(json.dumps({"facts": arm_facts([1, 2]).to_json(), "graph_checks": verdicts}))
    repeated = {"nodes": [{**n, "buffer_set": 0} for n in exported_graph()["nodes"]]}
    (arm_dir / "graph.json").write_text(json.dumps(repeated))
    suite = suite_from(tmp_path, SUITE)
    records = {"eager": ArmRecords(), "graph": read_arm(tmp_path / "run", "graph", 2)}
    results = {r.name: r.status for r in run_check(suite.checks[0], suite, records)}
    assert results["graph: graph:buffer-sets"] == "fail"


def test_a_graph_check_on_an_untraced_arm_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r'checks\.0\.arms\.0: arm "eager" exports no graph'):
        suite_from(tmp_path, SUITE + 'arms = ["eager"]\n')
