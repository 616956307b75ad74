"""The timeline of a run from its processes' phases: rank phases end with their slowest rank, the
segments add up to the wall time, and a crash keeps the phases before it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.phases import PhaseLog, read_rank_phases, timeline
from harness.report.timing import timing_view
from harness.rundir import phases_file


def harness_phases(launch: tuple[float, float]) -> list[dict]:
    log = PhaseLog()
    log.add("start", 0.0, 1.0)
    log.add("prepare", 1.0, 1.5)
    log.add("launch", *launch, group="g")
    log.add("judge", launch[1], launch[1] + 0.25)
    return log.phases


def rank(imports_end: float, build_end: float, steps_end: float) -> list[dict]:
    log = PhaseLog()
    log.add("imports", 2.0, imports_end)
    log.add("build", imports_end, build_end, arm="a", detail={"graph": {"origin": "cache", "cache": "hit"}})
    log.add("steps", build_end, steps_end, arm="a")
    return log.phases


def test_rank_segments_end_with_the_slowest_rank_and_add_up_to_the_wall_time() -> None:
    ranks = {"g": {0: rank(3.0, 4.0, 7.0), 1: rank(3.5, 3.75, 6.5)}}
    segments = timeline(harness_phases((1.5, 8.0)), ranks)
    got = [(s["segment"], s["arm"], s["seconds"]) for s in segments]
    assert got == [
        ("start", None, 1.0),
        ("prepare", None, 0.5),
        ("start processes", None, 0.5),  # until the last rank began its imports (both at 2.0)
        ("imports", None, 1.5),  # rank 1 is the last to finish them, at 3.5
        ("build", "a", 0.5),  # rank 0 builds until 4.0
        ("steps", "a", 3.0),  # rank 0 steps until 7.0
        ("exit", None, 1.0),  # the launch returns at 8.0
        ("judge", None, 0.25),
    ]
    assert sum(s["seconds"] for s in segments) == 8.25 - 0.0
    assert segments[4]["detail"] == "cache hit on 2 ranks"


def test_a_launch_without_rank_records_is_one_segment() -> None:
    segments = timeline(harness_phases((1.5, 4.0)), {})
    assert [(s["segment"], s["seconds"]) for s in segments][2:] == [("exit", 2.5), ("judge", 0.25)]


def test_a_failed_phase_is_recorded_and_the_error_passes_through(tmp_path: Path) -> None:
    path = phases_file(tmp_path, "g", 3)
    path.parent.mkdir()
    with path.open("w") as sink:

        def write(record: dict) -> None:
            sink.write(json.dumps(record) + "\n")

        log = PhaseLog(write)
        with pytest.raises(RuntimeError, match="boom"):
            with log.phase("steps", arm="a") as detail:
                detail["steps"] = 2
                raise RuntimeError("boom")
        sink.write('{"phase": "shutd')  # a line cut short by a crash
    (recorded,) = read_rank_phases(tmp_path, "g")[3]
    assert recorded["phase"] == "steps" and recorded["detail"] == {"steps": 2, "failed": True}
    assert recorded["end"] >= recorded["start"]


def test_the_report_table_flags_the_largest_segment() -> None:
    segments = timeline(harness_phases((1.5, 8.0)), {"g": {0: rank(3.0, 4.0, 7.0)}})
    view = timing_view({"timeline": segments, "total_s": 8.25})
    (largest,) = [row for row in view["rows"] if row["largest"]]
    assert (largest["segment"], largest["seconds"], largest["share"]) == ("steps", "3.00", "36%")
    assert view["headline"] == "8.25 s from the harness's start up to this report; largest: steps"
    assert timing_view(None) is None
