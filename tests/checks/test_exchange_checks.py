import copy

import pytest

from harness.checks.exchange import (
    check_buffer_reuse,
    check_chunk_signatures,
    check_launch_wait_pairing,
    check_planned_counts,
    check_planned_exchanges,
    check_same_event_sequence,
    training_plan,
)

STEPS, LAYERS, CHUNKS = 2, [1, 3], 4


def schedule(steps=STEPS, layers=LAYERS, chunks=CHUNKS, recompute=False, buffer_sets=2, rows=64, seq0=0):
    """A correct double-buffered MinimalAsyncEP-style schedule: at most `buffer_sets` exchanges in flight per kind."""
    events = []

    def emit(step, phase, layer, chunk, kind, op):
        events.append(
            {
                "step": step,
                "phase": phase,
                "layer": layer,
                "chunk": chunk,
                "kind": kind,
                "op": op,
                "buffer_set": chunk % buffer_sets,
                "seq": seq0 + len(events),
                "rows": rows,
            }
        )

    phases = [("fwd", layers)] + ([("recompute", layers[::-1])] if recompute else []) + [("bwd", layers[::-1])]
    for step in range(steps):
        for phase, order in phases:
            for layer in order:
                for kind in ("dispatch", "combine"):
                    for chunk in range(chunks):
                        if chunk >= buffer_sets:
                            emit(step, phase, layer, chunk - buffer_sets, kind, "wait")
                        emit(step, phase, layer, chunk, kind, "launch")
                    for chunk in range(max(chunks - buffer_sets, 0), chunks):
                        emit(step, phase, layer, chunk, kind, "wait")
    return events


def renumber(events):
    for i, e in enumerate(events):
        e["seq"] = i
    return events


def without(events, pred):
    return renumber([copy.deepcopy(e) for e in events if not pred(e)])


def test_correct_schedule_passes_every_check():
    events = schedule(recompute=True)
    assert check_launch_wait_pairing(events).status == "pass"
    assert check_buffer_reuse(events).status == "pass"
    assert check_chunk_signatures(events).status == "pass"
    r = check_planned_counts(events, plan=training_plan(STEPS, recompute=True), moe_layers=LAYERS, chunks=CHUNKS)
    assert r.status == "pass", r.detail
    assert r.detail.startswith(f"{STEPS * 3 * len(LAYERS) * CHUNKS * 2} launches")


def test_missing_wait_is_flagged():
    events = without(
        schedule(),
        lambda e: (
            (e["step"], e["phase"], e["layer"], e["chunk"], e["kind"], e["op"]) == (1, "bwd", 3, 2, "combine", "wait")
        ),
    )
    r = check_launch_wait_pairing(events)
    assert r.status == "fail" and r.first_divergent_step == 1
    assert "launch never waited: step 1 bwd layer 3 chunk 2 combine launch on buffer set 0" in r.detail


def test_wait_without_launch_is_flagged():
    events = without(
        schedule(),
        lambda e: (
            (e["step"], e["phase"], e["layer"], e["chunk"], e["kind"], e["op"])
            == (0, "fwd", 1, 0, "dispatch", "launch")
        ),
    )
    r = check_launch_wait_pairing(events)
    assert r.status == "fail" and r.first_divergent_step == 0
    assert r.detail.startswith(
        "event 1: wait without a launch: step 0 fwd layer 1 chunk 0 dispatch wait on buffer set 0"
    )


def test_wait_on_other_buffer_set_is_not_a_pairing():
    events = schedule()
    first_wait = next(e for e in events if e["op"] == "wait")
    first_wait["buffer_set"] = 1 - first_wait["buffer_set"]
    r = check_launch_wait_pairing(events)
    assert r.status == "fail" and r.detail.startswith("event 0: launch never waited:") and "(and 1 more)" in r.detail
    assert r.extra["problems"][1].startswith(
        "event 2: wait without a launch: step 0 fwd layer 1 chunk 0 dispatch wait on buffer set 1"
    )


def test_wait_before_its_launch_is_flagged():
    events = schedule(steps=1, layers=[0], chunks=1)
    events[0], events[1] = events[1], events[0]
    r = check_launch_wait_pairing(renumber(events))
    assert r.status == "fail" and "event 0: wait without a launch" in r.detail


def test_reused_buffer_set_is_flagged_with_location():
    # Three chunks in flight on two buffer sets: chunk 2 reuses set 0 while chunk 0 is unwaited.
    events = schedule(steps=1, layers=[5], chunks=3, buffer_sets=3)
    for e in events:
        e["buffer_set"] = e["chunk"] % 2
    assert check_launch_wait_pairing(events).status == "pass"
    r = check_buffer_reuse(events)
    assert r.status == "fail" and r.first_divergent_step == 0
    assert r.detail.startswith(
        "dispatch buffer set 0 reused at step 0 fwd layer 5 chunk 2 (event 2)"
        " while step 0 fwd layer 5 chunk 0 is in flight"
    )


def test_buffer_reuse_after_wait_is_fine():
    assert check_buffer_reuse(schedule(chunks=6, buffer_sets=2)).status == "pass"


def test_missing_chunk_is_flagged_by_counts():
    events = without(
        schedule(), lambda e: e["step"] == 1 and e["phase"] == "bwd" and e["layer"] == 1 and e["chunk"] == 3
    )
    r = check_planned_counts(events, plan=training_plan(STEPS), moe_layers=LAYERS, chunks=CHUNKS)
    assert r.status == "fail" and r.first_divergent_step == 1
    assert r.detail == "step 1 bwd layer 1 chunk 3: missing: dispatch 0 (expected 1), combine 0 (expected 1) launches"


def test_extra_layer_and_missing_recompute_are_flagged_by_counts():
    events = schedule(layers=[1, 2, 3])
    r = check_planned_counts(events, plan=training_plan(STEPS), moe_layers=LAYERS, chunks=CHUNKS)
    assert r.status == "fail" and r.detail.startswith("step 0 fwd layer 2 chunk 0: unexpected")
    r = check_planned_counts(schedule(), plan=training_plan(STEPS, recompute=True), moe_layers=LAYERS, chunks=CHUNKS)
    assert r.status == "fail" and r.detail.startswith("step 0 recompute layer 1 chunk 0: missing")


def test_duplicate_launch_is_flagged_by_counts():
    events = schedule(steps=1, layers=[1], chunks=1)
    events.insert(1, dict(events[0]))
    r = check_planned_counts(renumber(events), plan=training_plan(1), moe_layers=[1], chunks=1)
    assert r.status == "fail" and "wrong count: dispatch 2 (expected 1)" in r.detail


def test_chunk_with_different_rows_is_flagged():
    events = schedule()
    for e in events:
        if (e["step"], e["phase"], e["layer"], e["chunk"], e["kind"]) == (0, "bwd", 3, 2, "combine"):
            e["rows"] = 60
    r = check_chunk_signatures(events)
    assert r.status == "fail" and r.first_divergent_step == 0
    assert r.detail.startswith(
        "step 0 bwd layer 3: chunk 2 differs from chunk 0 at its exchange event 2:"
        " combine launch 60 vs combine launch 64"
    )


def test_chunk_missing_an_exchange_is_flagged_by_signatures():
    events = without(
        schedule(), lambda e: (e["step"], e["phase"], e["layer"], e["chunk"], e["kind"]) == (0, "fwd", 1, 1, "combine")
    )
    r = check_chunk_signatures(events)
    assert (
        r.status == "fail"
        and "chunk 1 differs from chunk 0 at its exchange event 2: nothing vs combine launch 64" in r.detail
    )


def test_same_event_sequence_ignores_seq_offsets():
    r = check_same_event_sequence(schedule(), schedule(seq0=1000), label_a="eager", label_b="graph")
    assert r.status == "pass"


def test_same_event_sequence_flags_first_difference():
    graph = schedule()
    graph[7], graph[8] = graph[8], graph[7]
    r = check_same_event_sequence(schedule(), renumber(graph), label_a="eager", label_b="graph")
    assert r.status == "fail" and r.extra["index"] == 7 and r.first_divergent_step == 0
    assert r.detail.startswith("event 7 differs: eager: ")
    assert r.values["eager"] != r.values["graph"]


def test_same_event_sequence_flags_a_shorter_arm():
    eager = schedule()
    r = check_same_event_sequence(eager, eager[:-3], label_a="eager", label_b="graph")
    assert r.status == "fail" and r.extra["index"] == len(eager) - 3
    assert "first extra in 'eager'" in r.detail
    assert check_same_event_sequence([], [], label_a="eager", label_b="graph").status == "fail"


def test_malformed_events_are_errors_not_passes():
    events = schedule(steps=1)
    del events[3]["rows"]
    assert check_launch_wait_pairing(events).status == "error"
    out_of_order = schedule(steps=1)
    out_of_order[2]["seq"] = 0
    r = check_buffer_reuse(out_of_order)
    assert r.status == "error" and "out of emission order" in r.detail
    bad_phase = schedule(steps=1)
    bad_phase[0]["phase"] = "forward"
    assert check_chunk_signatures(bad_phase).status == "error"


def test_token_exchange_passes_all_ranks():
    results = check_planned_exchanges(
        {0: schedule(), 1: schedule()}, plan=training_plan(STEPS), moe_layers=LAYERS, chunks=CHUNKS
    )
    assert [r.status for r in results] == ["pass"] * 4
    assert len({r.name for r in results}) == 4
    assert all(r.detail.startswith("all 2 ranks: ") for r in results)


def test_token_exchange_names_the_failing_rank():
    broken = without(schedule(), lambda e: e["op"] == "wait" and e["step"] == 1 and e["chunk"] == 0)
    results = check_planned_exchanges(
        {0: schedule(), 1: broken}, plan=training_plan(STEPS), moe_layers=LAYERS, chunks=CHUNKS
    )
    pairing = results[0]
    assert pairing.status == "fail" and pairing.detail.startswith("rank 1: ")
    assert pairing.extra["failing_ranks"] == [1] and pairing.first_divergent_step == 1


@pytest.mark.parametrize("events_by_rank", [{0: [], 1: []}, {0: schedule(), 1: []}, {}])
def test_empty_event_log_never_passes(events_by_rank):
    results = check_planned_exchanges(events_by_rank, plan=training_plan(STEPS), moe_layers=LAYERS, chunks=CHUNKS)
    assert len(results) == 4 and all(r.status == "fail" for r in results)


def test_single_check_on_empty_events_fails_counts():
    r = check_planned_counts([], plan=training_plan(1), moe_layers=[0], chunks=2)
    assert r.status == "fail" and "missing" in r.detail
