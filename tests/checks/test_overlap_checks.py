"""overlap: the next chunk's exchange is in flight while a chunk waits, judged from a traced arm's
graph.json and an eager arm's events, on hand-made records scheduled with and without overlap."""

from __future__ import annotations

from pathlib import Path

import pytest
from exported_graphs import MOE_LAYERS, OVERLAPPED, SERIAL, arm_facts, exchange_events, exported_graph
from suite_files import suite_from

from harness.checks import run_check
from harness.checks.overlap import overlap_problem
from harness.records import ArmRecords
from harness.results import CheckResult
from harness.suites import SuiteError

SUITE = """
name = "mini"
description = "chunked arms"
ranks = 2
steps = 1
[train]
routing = "forced-balanced"
chunks = 2
[arms.plain]
chunking = "none"
[arms.eager]
chunking = "eager"
[arms.graph]
chunking = "graph"
[[checks]]
kind = "overlap"
"""


def _judge(tmp_path: Path, graph: dict | None, events: dict[int, list[dict]]) -> dict[str, CheckResult]:
    suite = suite_from(tmp_path, SUITE)
    layers = list(MOE_LAYERS)
    records = {
        "plain": ArmRecords(),
        "eager": ArmRecords(events=events, facts=arm_facts(layers)),
        "graph": ArmRecords(graph=graph, facts=arm_facts(layers)),
    }
    return {r.name: r for r in run_check(suite.checks[0], suite, records)}


def test_overlap_needs_the_next_chunks_kth_launch_before_this_chunks_kth_wait() -> None:
    def sequence(schedule: tuple) -> list[tuple[int, str]]:
        return [(chunk, "launch" if item % 2 == 0 else "wait") for chunk, item in schedule]

    assert overlap_problem(sequence(OVERLAPPED)) is None
    serial = "chunk 0 waits for its exchange 0 before chunk 1 launches its exchange 0"
    assert overlap_problem(sequence(SERIAL)) == serial
    second_only = ((0, 0), (1, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3))
    assert overlap_problem(sequence(second_only)) == (
        "chunk 0 waits for its exchange 1 before chunk 1 launches its exchange 1"
    )
    assert overlap_problem([(0, "launch"), (0, "wait")]) == "only chunks [0] launch: nothing to overlap"


def test_scheduled_chunks_overlap_in_every_region_of_the_graph_and_the_eager_forward(tmp_path: Path) -> None:
    results = _judge(tmp_path, exported_graph(), {0: exchange_events(2), 1: exchange_events(2)})
    assert list(results) == ["eager: overlap", "graph: overlap"]  # the unchunked arm promises nothing
    graph, eager = results["graph: overlap"], results["eager: overlap"]
    assert graph.status == eager.status == "pass"
    assert graph.detail == "4 of 4 graph regions overlap (100%): each chunk waits after the next chunk launches"
    # Eager backward is autograd's, one chunk after another: only the scheduled forward is judged.
    assert eager.detail.startswith("8 of 8 forward regions overlap (100%)")
    assert eager.extra == {"regions": 8, "overlapping": 8, "fraction": 1.0}


def test_a_scheduler_that_waits_before_the_next_launch_fails_with_the_fraction_that_overlaps(tmp_path: Path) -> None:
    half = exported_graph(OVERLAPPED, backward_schedule=SERIAL)
    serial_forward = {rank: exchange_events(forward=SERIAL) for rank in (0, 1)}
    results = _judge(tmp_path, half, serial_forward)
    graph, eager = results["graph: overlap"], results["eager: overlap"]
    assert graph.status == "fail" and graph.extra["fraction"] == 0.5
    assert graph.detail == (
        "2 of 4 graph regions overlap (50%); model.layers.1.mlp bwd: chunk 1 waits for its exchange 0"
        " before chunk 0 launches its exchange 0 (and 1 more)"
    )
    assert eager.status == "fail" and eager.extra["fraction"] == 0.0
    assert eager.detail.startswith(
        "0 of 4 forward regions overlap (0%); logical rank 0 step 1 fwd layer 1: chunk 0 waits for its exchange 0"
    )


def test_absent_records_fail_and_malformed_events_are_an_error(tmp_path: Path) -> None:
    results = _judge(tmp_path, None, {0: exchange_events(), 1: []})
    assert results["graph: overlap"].status == "fail"
    assert results["graph: overlap"].detail == "arm 'graph' exported no graph.json: no graph to check"
    assert results["eager: overlap"].status == "fail"
    assert results["eager: overlap"].detail == "logical ranks [1] recorded no token-exchange events"
    backward_only = [e for e in exchange_events() if e["phase"] == "bwd"]
    nothing_scheduled = _judge(tmp_path, exported_graph(), {0: backward_only, 1: backward_only})["eager: overlap"]
    assert nothing_scheduled.status == "fail" and nothing_scheduled.detail.startswith("no forward regions recorded")
    malformed = [{**e, "chunk": "0"} for e in exchange_events()]
    error = _judge(tmp_path, exported_graph(), {0: malformed, 1: malformed})["eager: overlap"]
    assert error.status == "error" and error.detail.startswith("malformed events of logical rank 0: event 0")


def test_an_arm_whose_schedule_promises_no_overlap_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SuiteError, match=r'checks\.0\.arms\.0: arm "plain" is not chunked \(its facts: chunks = 1\)'):
        suite_from(tmp_path, SUITE + 'arms = ["plain"]\n')
    one_set = SUITE.replace('chunking = "eager"', 'chunking = "eager"\nnum_buffer_sets = 1')
    with pytest.raises(SuiteError, match=r"arm \"eager\" promises no overlap: chunks = 2, num_buffer_sets = 1"):
        suite_from(tmp_path, one_set + 'arms = ["eager"]\n')
    unchunked = SUITE.replace("chunks = 2", "chunks = 1")
    with pytest.raises(SuiteError, match=r"checks\.0: needs a chunked arm with chunks >= 2 and num_buffer_sets >= 2"):
        suite_from(tmp_path, unchunked)


def test_regions_other_than_the_config_implies_fail_however_well_they_overlap(tmp_path: Path) -> None:
    """A graph whose backward flag was lost: both directions of a layer merge into one region, which
    overlaps; so does an eager forward that lost a MoE layer's exchanges."""
    merged = exported_graph()
    for node in merged["nodes"]:
        node["phase"] = "fwd"
    lost_layer = [e for e in exchange_events(2) if e["layer"] != 2]
    results = _judge(tmp_path, merged, {0: lost_layer, 1: exchange_events(2)})
    graph, eager = results["graph: overlap"], results["eager: overlap"]
    assert graph.status == "fail"
    assert graph.detail.startswith(
        "2 of 2 graph regions overlap (100%); judged 2 regions where the config implies 4;"
        " missing ['model.layers.1.mlp bwd', 'model.layers.2.mlp bwd']"
    )
    assert eager.status == "fail"
    assert "logical rank 0 step 1 fwd: regions of layers [1], the MoE layers are [1, 2]" in eager.detail
    nothing_expected = _judge(tmp_path, exported_graph(), {0: exchange_events(), 1: exchange_events()})
    assert nothing_expected["graph: overlap"].status == "pass"
