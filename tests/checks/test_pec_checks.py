"""The pec-invariants family on hand-made event lists: each invariant passes on the orders the
three trainers promise and fails on the bug it exists for, naming batch, part and call."""

from __future__ import annotations

from pathlib import Path

import pytest
from suite_files import suite_from

from harness.checks.pec import (
    FRESH,
    INVARIANTS,
    NO_AUTOGRAD,
    NOL_HANDOFF,
    OL_WINDOW,
    ONE_EACH,
    PER_CALL,
    check_pec,
    expected_starts,
)
from harness.suites import SuiteError

MODULE = "model.embed_tokens"
VOCAB = 16
# BATCHES[k][n] = the ids logical rank k looks up for batch n + 1. Globally: batch 1 holds
# {0, 1, 5, 8, 9, 12}, batch 2 {1, 2, 8, 10, 13}, so OL 1 = {1, 8} and NOL 1 = {0, 5, 9, 12}; batch 3
# looks up 9 and 12 again, which NOL 1 updates; rank 0 reads rows 9 and 12, owned by rank 1.
BATCHES = [
    [[0, 1, 9], [1, 2, 10], [3, 9], [0, 4]],
    [[5, 8, 12], [8, 13], [12, 14, 2], [5, 15]],
]


def _owner(row: int, ranks: int) -> int:
    return row * ranks // VOCAB


def _split(batches: list[list[list[int]]], batch: int, fault: str | None) -> dict[str, set[int]]:
    """OL: the ids of ``batch`` that the next batch (on any rank) looks up again; NOL the rest."""
    ids = set().union(*(rank_batches[batch - 1] for rank_batches in batches))
    last = batch == len(batches[0])
    ol = ids if last else ids & set().union(*(rank_batches[batch] for rank_batches in batches))
    if fault == "ol-as-nol" and batch == 1:
        ol = ol - {min(ol)}
    return {"OL": ol, "NOL": ids - ol}


def pec_events(
    trainer: str = "pipelined", fault: str | None = None, batches: list[list[list[int]]] = BATCHES
) -> dict[int, list[dict]]:
    """What each logical rank records when its trainer runs the PEC pipeline (see harness.checks.pec),
    with one planted ``fault``: nol-two-late, ol-before-backward, no-drain, ol-as-nol."""
    ranks, count = len(batches), len(batches[0])
    events: dict[int, list[dict]] = {k: [] for k in range(ranks)}

    def emit(call: int, op: str, batch: int, part: str | None = None, ids: dict[int, set[int]] | None = None) -> None:
        for k, rank_events in events.items():
            rows = sorted((ids or {}).get(k, set()))
            module = MODULE if op in ("lookup", "start", "apply") else None
            autograd = trainer == "legacy" and op == "start" and part == "OL"
            rank_events.append(
                dict(seq=len(rank_events), call=call, op=op, batch=batch, part=part, module=module, rows=len(rows))
                | {"ids": rows, "in_autograd": autograd}
            )

    def gradient(call: int, op: str, batch: int, part: str) -> None:
        rows = _split(batches, batch, fault)[part]
        if op == "start":
            ids = {k: rows & set(batches[k][batch - 1]) for k in range(ranks)}
        else:
            ids = {k: {row for row in rows if _owner(row, ranks) == k} for k in range(ranks)}
        emit(call, op, batch, part, ids)

    lag = {"sequential": 0, "pipelined": 1, "legacy": 1}[trainer] + (fault == "nol-two-late")
    for call in range(1, count + 1):
        emit(call, "lookup", call, ids={k: set(batches[k][call - 1]) for k in range(ranks)})
        if trainer == "sequential":
            emit(call, "backward_done", call)
            for op in ("start", "apply"):
                for part in ("OL", "NOL"):
                    gradient(call, op, call, part)
            emit(call, "optimizer_step", call)
            continue
        handed = [batch for batch in range(1, call) if batch + lag == call]
        for op in ("start", "apply"):  # around the forward of this call
            for batch in handed:
                gradient(call, op, batch, "NOL")
        early = trainer == "legacy" or fault == "ol-before-backward"  # legacy: from inside autograd
        if early:
            gradient(call, "start", call, "OL")
        emit(call, "backward_done", call)
        if not early:
            gradient(call, "start", call, "OL")
        emit(call, "optimizer_step", call)
        gradient(call, "apply", call, "OL")
        if call == count:
            drained = [batch for batch in range(max(1, call - lag + 1), call + 1) if batch + lag > call]
            for batch in drained if fault != "no-drain" else [b for b in drained if b != count]:
                for op in ("start", "apply"):
                    gradient(call, op, batch, "NOL")
    return events


def _results(events: dict[int, list[dict]], trainer: str = "pipelined", batches: int = 4) -> dict[str, dict]:
    results = check_pec(events, trainer, batches)
    assert [r.name for r in results] == list(INVARIANTS)
    return {r.name: r for r in results}


@pytest.mark.parametrize("trainer", ["pipelined", "sequential"])
def test_every_invariant_passes_on_the_order_its_trainer_promises(trainer: str) -> None:
    results = _results(pec_events(trainer), trainer)
    assert {name: r.status for name, r in results.items()} == dict.fromkeys(INVARIANTS, "pass"), results
    shape = "1, 2 x 2, 3" if trainer == "pipelined" else "2 x 4"
    assert results[PER_CALL].detail == f"{trainer}: starts per call {shape}, on 2 logical ranks"
    assert results[ONE_EACH].detail.startswith("8 starts (OL + NOL x 4 batches) per module and logical rank")


def test_expected_starts_per_call_fill_steady_and_drain() -> None:
    assert [expected_starts("pipelined", c, 5) for c in range(1, 6)] == [1, 2, 2, 2, 3]
    assert [expected_starts("pipelined", c, 1) for c in range(1, 2)] == [2]  # OL 1 and its drained NOL 1
    assert [expected_starts("sequential", c, 3) for c in range(1, 4)] == [2, 2, 2]


def test_legacy_order_fails_the_autograd_invariant_naming_batch_part_and_call() -> None:
    results = _results(pec_events("legacy"), "legacy")
    assert results[NO_AUTOGRAD].status == "fail"
    assert results[NO_AUTOGRAD].detail.startswith(
        "logical rank 0: OL start of batch 1 (call 1) started inside autograd"
    )
    assert results[NO_AUTOGRAD].first_divergent_step == 1
    assert results[OL_WINDOW].status == "fail"  # fired from backward: before backward is done
    assert results[FRESH].status == results[NOL_HANDOFF].status == results[PER_CALL].status == "pass"


def test_nol_applied_two_batches_late_fails_handoff_and_fresh_lookups() -> None:
    results = _results(pec_events(fault="nol-two-late"))
    assert results[NOL_HANDOFF].status == "fail"
    assert results[NOL_HANDOFF].detail.startswith(
        "logical rank 0: NOL start of batch 1 (call 3), expected in call 2 (late)"
    )
    assert results[FRESH].status == "fail"
    assert results[FRESH].detail.startswith(
        "logical rank 0: lookup of batch 3 (call 3) reads row 9 before the NOL update of batch 1"
        " is applied (call 3, logical rank 1)"
    )
    assert results[PER_CALL].status == "fail"  # call 2 starts only OL 2; call 4 drains two NOLs
    assert results[NO_AUTOGRAD].status == results[ONE_EACH].status == results[OL_WINDOW].status == "pass"


def test_ol_started_before_backward_is_done_fails_the_ol_window() -> None:
    results = _results(pec_events(fault="ol-before-backward"))
    assert results[OL_WINDOW].status == "fail"
    assert results[OL_WINDOW].detail.startswith(
        "logical rank 0: OL start of batch 1 (call 1) started before backward of batch 1 was done"
    )
    assert results[NO_AUTOGRAD].status == "pass"  # not inside autograd, only too early


def test_missing_drain_fails_the_counts() -> None:
    results = _results(pec_events(fault="no-drain"))
    assert results[ONE_EACH].status == "fail"
    assert results[ONE_EACH].detail.startswith(
        "logical rank 0: NOL of batch 4: started 0 and applied 0 times (calls -), expected once each"
    )
    assert results[PER_CALL].status == "fail"
    assert results[PER_CALL].detail.startswith("logical rank 0: call 4 started 2, expected 3")
    assert results[FRESH].status == results[NOL_HANDOFF].status == "pass"


def test_an_ol_row_classed_nol_is_read_stale_by_the_next_batch() -> None:
    results = _results(pec_events(fault="ol-as-nol"))
    assert results[FRESH].status == "fail"
    assert results[FRESH].detail.startswith(
        "logical rank 0: lookup of batch 2 (call 2) reads row 1 before the NOL update of batch 1"
        " is applied (call 2, logical rank 0)"
    )
    assert results[FRESH].first_divergent_step == 2
    assert results[NOL_HANDOFF].status == results[ONE_EACH].status == "pass"  # the schedule itself is right


def test_ranks_out_of_lockstep_cannot_be_ordered_and_fail_fresh_lookups() -> None:
    events = pec_events()
    events[1][6], events[1][7] = events[1][7], events[1][6]  # rank 1 applies NOL 1 before it starts it
    for seq, e in enumerate(events[1]):
        e["seq"] = seq
    results = _results(events)
    assert results[FRESH].status == "fail"
    assert results[FRESH].detail.startswith(
        "logical ranks 0 and 1 are not in lockstep at event 6:"
        " NOL start of batch 1 (call 2) vs NOL apply of batch 1 (call 2);"
    )
    assert results[ONE_EACH].status == "fail"
    assert "logical rank 1: NOL of batch 1: applied (call 2) before it started (call 2)" in results[ONE_EACH].detail


def test_a_lost_row_fails_conservation_and_a_duplicate_apply_fails_once() -> None:
    events = pec_events()
    apply_ol_1 = next(e for e in events[1] if (e["op"], e["part"], e["batch"]) == ("apply", "OL", 1))
    apply_ol_1.update(ids=[], rows=0)  # rank 1 owns row 8 of OL 1 and never applies it
    assert _results(events)[ONE_EACH].detail == "OL of batch 1: rows [8] started, never applied"
    events = pec_events()
    events[0].append({**events[0][-1], "seq": events[0][-1]["seq"] + 1})
    assert _results(events)[ONE_EACH].detail.startswith(
        "logical rank 0: NOL of batch 4: started 1 and applied 2 times (calls 4, 4, 4)"
    )


def test_a_rank_without_events_fails_every_invariant() -> None:
    events = pec_events()
    events[1] = []
    results = check_pec(events, "pipelined", 4)
    assert {r.status for r in results} == {"fail"}
    assert results[0].detail == "logical rank 1 recorded no PEC events (pec.rank<k>.jsonl)"
    assert {r.status for r in check_pec({}, "pipelined", 4)} == {"fail"}


def test_events_without_starts_or_lookups_fail() -> None:
    events = {k: [e for e in evs if e["op"] not in ("start", "apply", "lookup")] for k, evs in pec_events().items()}
    results = _results(events)
    assert results[NO_AUTOGRAD].detail == "no gradient all-to-all start recorded: nothing to check"
    assert results[FRESH].detail == "no lookups recorded: no row to check"
    assert all(r.status == "fail" for r in results.values())


def test_a_short_run_fails_on_the_batches_it_never_reached() -> None:
    results = _results(pec_events(), batches=5)
    assert results[ONE_EACH].status == results[PER_CALL].status == results[OL_WINDOW].status == "fail"
    assert "logical rank 0: batch 5 has no single backward_done and optimizer_step" in results[OL_WINDOW].detail


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"op": "send"}, "'op' must be one of"),
        ({"part": None}, "'part' of a start must be one of ('OL', 'NOL')"),
        ({"ids": [3, 1]}, "'ids' must be distinct integers in ascending order, got [3, 1]"),
        ({"rows": 7}, "'rows' 7 must count the"),
        ({"in_autograd": "no"}, "'in_autograd' must be true or false"),
        ({"seq": -5}, "seq -5 does not increase"),
        ({"call": 0}, "call and batch count from 1"),
    ],
)
def test_malformed_events_make_every_invariant_an_error(change: dict, reason: str) -> None:
    events = pec_events()
    start = next(i for i, e in enumerate(events[1]) if e["op"] == "start")
    events[1][start] = {**events[1][start], **change}
    results = check_pec(events, "pipelined", 4)
    assert {r.status for r in results} == {"error"}
    assert results[0].detail.startswith(f"malformed events: logical rank 1 event {start}: ")
    assert reason in results[0].detail


PEC_SUITE = """
name = "pec-arms"
description = "a PEC arm and a plain one"
ranks = 2
steps = 3
[arms.pipelined]
pec = "pipelined"
[arms.plain]
[[checks]]
kind = "pec-invariants"
"""


def test_pec_invariants_read_every_pec_arm_and_refuse_an_arm_without_a_table(tmp_path: Path) -> None:
    check = suite_from(tmp_path, PEC_SUITE).checks[0]
    assert (check.kind, check.name, check.arms) == ("pec-invariants", "pec-invariants", ("pipelined",))
    with pytest.raises(SuiteError, match='checks.0.arms.0: arm "plain" has no PEC table'):
        suite_from(tmp_path, PEC_SUITE + 'arms = ["plain"]\n')
    with pytest.raises(SuiteError, match="checks.0: needs an arm with a PEC table; the suite has none"):
        suite_from(tmp_path, PEC_SUITE.replace('pec = "pipelined"\n', ""))


def test_a_pec_arms_golden_config_names_its_trainer_and_nothing_left_at_a_default(tmp_path: Path) -> None:
    arms = suite_from(tmp_path, PEC_SUITE.replace('pec = "pipelined"', 'pec = "sequential"\npec_overlap = 0.5')).arms
    assert arms["pipelined"].golden_config == {"pec": "sequential"}
    assert arms["plain"].golden_config == {}
